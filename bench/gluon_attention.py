"""The warp-specialised Gluon global attention (models/sam/gluon_attention.py) beside the
served Triton kernel (models/sam/fused_attention.py) and SDPA without any bias (a floor,
not SAM's arithmetic), on SAM ViT-B's global layer: q, k and v read in place out of the
qkv projection `[B, 4096, 3, 12, 64]`, the output token-major.

First it checks the Gluon kernel's output against the Triton kernel's (and both against
fp32 arithmetic with the dense bias on one image) and stops there if they differ, so a
wrong or hung kernel shows in the first seconds of a GPU call. Timings are CUDA graphs of
`--reps` calls, the median of `--iters`, ms a layer.

    python3 -m bench.gluon_attention --batch 8
    python -m bench.gluon_attention --resources   # no GPU: compiled for sm_90
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, write_json
from bench.int8_gemm import graphed_ms
from models.sam import fused_attention, gluon_attention
from models.sam.gluon_attention import GRID, HEAD_DIM, launch_gluon_attention

HEADS = 12  # ViT-B


def compile_for_hopper(quant_out: bool = False) -> Any:
    """The kernel compiled for sm_90 by this machine's Triton (no GPU needed), as
    `launch_gluon_attention` launches it for ViT-B (`quant_out`: its output int8 for the
    projection)."""
    from bench.gemm_resources import compile_gluon, gluon_descriptor

    def desc(rows: int, cols: int, block: list[int], dtype: torch.dtype = torch.bfloat16) -> str:
        layout = gluon_attention.shared_layout(block, dtype)
        return gluon_descriptor(rows, cols, dtype, block, layout)

    tile, table = [GRID, HEAD_DIM], [2 * GRID, HEAD_DIM]
    signature = {
        "qkv_desc": desc(GRID * GRID, 3 * HEADS * HEAD_DIM, tile),
        "rh_desc": desc(2 * GRID - 1, HEAD_DIM, table),
        "rw_desc": desc(2 * GRID - 1, HEAD_DIM, table),
        "o_desc": desc(GRID * GRID, HEADS * HEAD_DIM, tile,
                       torch.int8 if quant_out else torch.bfloat16),
        "out_inv_ptr": "*fp32" if quant_out else "*bf16",
        "n_tiles": "i32", "q_tiles": "i32", "heads": "i32", "num_programs": "i32",
    }  # fmt: skip
    constexprs = {"GRID_N": GRID, "STAGES": gluon_attention.STAGES,
                  "QK_SCALE": HEAD_DIM**-0.5 * gluon_attention.LOG2E, "QUANT_OUT": quant_out,
                  "CONSUMER_REGS": gluon_attention.CONSUMER_REGISTERS,
                  "PRODUCER_REGS": gluon_attention.PRODUCER_REGISTERS}  # fmt: skip
    return compile_gluon(gluon_attention._kernel(), signature, constexprs,
                         gluon_attention.KERNEL_MAX_REGISTERS)  # fmt: skip


def resources_row(compiled: Any) -> dict[str, Any]:
    """What a compiled Gluon attention kernel takes (both benches' `--resources`): its
    `wgmma`, registers, stack, shared memory, warp groups' register budgets, and its
    exponentials."""
    from bench.gemm_resources import resources, setmaxnreg

    ptx = compiled.asm["ptx"]
    budgets = " ".join(f"{d} {n}" for d, n in sorted(setmaxnreg(ptx)))
    return {**resources(compiled), "setmaxnreg": budgets,
            "ex2": len(re.findall(r"ex2\.approx", ptx))}  # fmt: skip


def exponentials_before_p_v_wait(compiled: Any) -> int:
    """The exponentials ptxas placed between a consumer's wait for its scores (`wgmma`
    wait with one group left: `p . v`) and its wait for that `p . v`: how much of the
    softmax runs beside the product (the first such pair in the SASS)."""
    from bench.gemm_resources import cuobjdump

    code = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", cuobjdump(compiled, "-sass"))
    start = next(
        i for i, text in enumerate(code) if text.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    )
    end = next(
        i for i in range(start, len(code)) if code[i].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    )
    return sum(text.startswith("MUFU.EX2") for text in code[start:end])


def print_resources(compile_kernel: Callable[[], Any] = compile_for_hopper) -> None:
    """`--resources` (both benches): what the kernel takes, from the sm_90 compile alone so
    no GPU is needed, and how much of its softmax ptxas runs beside `p . v` (ptxas decides
    that, not the PTX's order)."""
    import triton

    compiled = compile_kernel()
    row = {**resources_row(compiled), "ex2 beside p.v": exponentials_before_p_v_wait(compiled)}
    print(f"Triton {triton.__version__}, sm_90")
    print_table([row], list(row))


def inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv as the encoder's projection makes it (activations of a few units), and tables
    of SAM's scale."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(batch, GRID * GRID, 3, HEADS, HEAD_DIM, device=dev, generator=g)
    rph = torch.randn(2 * GRID - 1, HEAD_DIM, device=dev, generator=g) * 0.2
    rpw = torch.randn(2 * GRID - 1, HEAD_DIM, device=dev, generator=g) * 0.2
    return qkv.to(torch.bfloat16), rph.to(torch.bfloat16), rpw.to(torch.bfloat16)


def dense_reference(qkv: torch.Tensor, rph: torch.Tensor, rpw: torch.Tensor) -> torch.Tensor:
    """fp32 with the dense bias, Meta's arithmetic, for the first image only."""
    q, k, v = qkv[:1].float().permute(2, 0, 3, 1, 4).unbind(0)  # [1, heads, N, C]
    idx = torch.arange(GRID, device=qkv.device)
    rel = idx[:, None] - idx[None, :] + GRID - 1
    rh = rph.float()[rel]  # [GRID, GRID, C]: (qy, y')
    rw = rpw.float()[rel]
    r_q = q.reshape(1, HEADS, GRID, GRID, HEAD_DIM)
    bias_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, rh)  # [1, heads, qy, qx, y']
    bias_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, rw)  # [1, heads, qy, qx, x']
    bias = (bias_h[..., :, None] + bias_w[..., None, :]).reshape(1, HEADS, GRID**2, GRID**2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return out.transpose(1, 2).reshape(1, GRID * GRID, HEADS * HEAD_DIM)


def int8_out(floats: torch.Tensor, launch_int8: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """The kernel's int8 output (`out_inv_scale`, scales of about the served spread)
    against its bf16 output quantised by torch (`models.mlp_static.quantize_static`): the
    largest difference. 1 where the bf16 rounding of the torch side moved a value across a
    half step; more is a fault."""
    from models.mlp_static import quantize_static

    g = torch.Generator(device=floats.device).manual_seed(3)
    spread = 1 + torch.rand(floats.shape[-1], generator=g, device=floats.device)
    amax = floats.float().abs().amax(dim=(0, 1)) * spread
    inv = 127.0 / amax.clamp(min=1e-6)
    got = launch_int8(inv)
    torch.cuda.synchronize()
    if got.dtype != torch.int8:
        raise SystemExit(f"the kernel's int8 output came back as {got.dtype}: not timed")
    return int((got.int() - quantize_static(floats, inv).int()).abs().max())


def check(batch: int) -> dict[str, Any]:
    qkv, rph, rpw = inputs(batch, seed=1)
    got = launch_gluon_attention(qkv, rph, rpw)
    torch.cuda.synchronize()
    served = fused_attention.fused_rel_pos_attention(qkv, rph, rpw)
    ref = dense_reference(qkv, rph, rpw)
    scale = ref.abs().max()
    row = {
        "batch": batch,
        "gluon vs triton max_rel": float((got.float() - served.float()).abs().max() / scale),
        "gluon vs fp32 max_rel (image 0)": float((got[:1].float() - ref).abs().max() / scale),
        "triton vs fp32 max_rel (image 0)": float((served[:1].float() - ref).abs().max() / scale),
        "nan": bool(got.isnan().any()),
        "int8 out max diff": int8_out(
            got, lambda inv: launch_gluon_attention(qkv, rph, rpw, out_inv_scale=inv)
        ),
    }
    print(row, flush=True)
    return row


def measure(batch: int, reps: int, iters: int) -> dict[str, Any]:
    qkv, rph, rpw = inputs(batch)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    flops = 4 * batch * HEADS * (GRID * GRID) ** 2 * HEAD_DIM
    row: dict[str, Any] = {"batch": batch}
    forms: list[tuple[str, Callable[[], Any]]] = [
        ("triton ms", lambda: fused_attention.fused_rel_pos_attention(qkv, rph, rpw)),
        ("gluon ms", lambda: launch_gluon_attention(qkv, rph, rpw)),
        ("sdpa no bias ms", lambda: F.scaled_dot_product_attention(q, k, v)),
    ]
    for name, fn in forms:
        row[name] = graphed_ms(fn, reps, iters)
        row[name.replace("ms", "TFLOP/s")] = flops / row[name] / 1e9
        print(f"  {name}: {row[name]:.4f}", flush=True)
    row["gluon / triton speed"] = row["triton ms"] / row["gluon ms"]
    return row


def bench_main(
    description: str,
    show_resources: Callable[[], None],
    launch_once: Callable[[int], None],
    check_one: Callable[[int], dict[str, Any]],
    measure_one: Callable[[int, int, int], dict[str, Any]],
) -> None:
    """The command line of a Gluon attention bench (this one and
    bench/gluon_window_attention.py): the sm_90 compile alone, one launch for Nsight
    Compute, or the check (2 images) and, where it passes, the timings: a wrong or hung
    kernel shows before any time is spent timing it."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--resources", action="store_true", help="compile for sm_90 only")
    p.add_argument("--check-only", action="store_true")
    p.add_argument(
        "--launch-only", action="store_true",
        help="one launch at the first --batch: for Nsight Compute",
    )  # fmt: skip
    args = p.parse_args()
    if args.resources:
        show_resources()
        return
    if not torch.cuda.is_available():
        raise SystemExit("the Gluon attention runs only on a Hopper GPU")
    if args.launch_only:
        launch_once(args.batch[0])
        torch.cuda.synchronize()
        return
    env = environment()
    print(env, flush=True)
    checks = [check_one(2)]
    print_table(checks, list(checks[0]))
    if (checks[0]["nan"] or checks[0]["gluon vs triton max_rel"] > 0.02
            or checks[0]["int8 out max diff"] > 1):  # fmt: skip
        raise SystemExit("the Gluon kernel's output differs from the Triton kernel's: not timed")
    if args.check_only:
        return
    rows = [measure_one(b, args.reps, args.iters) for b in args.batch]
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    print_table(rows, list(rows[0]))
    if args.json:
        write_json(Path(args.json), {"environment": env, "checks": checks, "rows": rows})


def main() -> None:
    def launch_once(batch: int) -> None:
        launch_gluon_attention(*inputs(batch))

    bench_main(__doc__ or "", print_resources, launch_once, check, measure)


if __name__ == "__main__":
    main()
