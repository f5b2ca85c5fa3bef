"""The warp-specialised Gluon window attention (models/sam/gluon_window_attention.py) beside
the served Triton kernel (models/sam/fused_attention.py) on SAM ViT-B's windowed layer: q,
k and v read in place out of the qkv projection of the whole 64 x 64 grid `[B, 4096, 3,
12, 64]`, 14 x 14 windows padded past the grid's edge as Meta pads them (qkv's bias), the
output token-major.

First it checks the Gluon kernel's output against the Triton kernel's, and both against
fp32 arithmetic on Meta's padded, partitioned windows with the dense bias (one image), and
stops there if they differ, so a wrong or hung kernel shows in the first seconds of a GPU
call. Timings are CUDA graphs of `--reps` calls, the median of `--iters`, ms a layer.

    python3 -m bench.gluon_window_attention --batch 8
    python -m bench.gluon_window_attention --resources   # no GPU: compiled for sm_90
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench.gluon_attention import bench_main, int8_out, print_resources
from bench.int8_gemm import graphed_ms
from models.sam import fused_attention, gluon_window_attention
from models.sam.gluon_window_attention import (
    BOX,
    EXTRA,
    HEAD_DIM,
    KEYS,
    TABLE,
    WINDOW,
    launch_gluon_window_attention,
)

HEADS = 12  # ViT-B
GRID = 64  # ViT-B's token grid at 1024 px: 5 x 5 windows, the last row and column padded


def compile_for_hopper(quant_out: bool = False) -> Any:
    """The kernel compiled for sm_90 by this machine's Triton (no GPU needed), as
    `launch_gluon_window_attention` launches it for ViT-B's windowed layers (`quant_out`:
    its output int8 for the projection)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from bench.gemm_resources import compile_gluon

    def desc(shape: list[int], block: list[int]) -> str:
        layout = gluon_window_attention.shared_layout(block, torch.bfloat16)
        t = torch.empty(*shape, dtype=torch.bfloat16)
        return mangle_type(TensorDescriptor.from_tensor(t, block, layout))

    signature = {
        "qkv_desc": desc([1, GRID, GRID, 3 * HEADS * HEAD_DIM], [1, BOX, BOX, HEAD_DIM]),
        "t_desc": desc([HEADS * 2 * TABLE, HEAD_DIM], [TABLE, HEAD_DIM]),
        "c_desc": desc([2 * KEYS, EXTRA], [KEYS, EXTRA]),
        "out_ptr": "*i8" if quant_out else "*bf16", "bias_v_ptr": "*bf16",
        "out_inv_ptr": "*fp32" if quant_out else "*bf16",
        **dict.fromkeys(("n_jobs", "n_win", "windows_w", "heads", "height", "width", "pad_x",
                         "pad_y", "num_programs"), "i32"),
    }  # fmt: skip
    constexprs = {"WINDOW_": WINDOW, "BOX_": BOX,
                  "QK_SCALE": HEAD_DIM**-0.5 * gluon_window_attention.LOG2E,
                  "REL_SCALE": HEAD_DIM**0.5, "HAS_BIAS": True, "OUTSIDE": -30000.0,
                  "QUANT_OUT": quant_out,
                  "CONSUMER_REGS": gluon_window_attention.CONSUMER_REGISTERS,
                  "PRODUCER_REGS": gluon_window_attention.PRODUCER_REGISTERS}  # fmt: skip
    return compile_gluon(gluon_window_attention._kernel(), signature, constexprs,
                         gluon_window_attention.KERNEL_MAX_REGISTERS,
                         divisible=("out_ptr", "bias_v_ptr", "out_inv_ptr"))  # fmt: skip


def inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """qkv as the encoder's projection makes it (activations of a few units), tables of
    SAM's scale and a qkv bias."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(batch, GRID * GRID, 3, HEADS, HEAD_DIM, device=dev, generator=g)
    rph = torch.randn(2 * WINDOW - 1, HEAD_DIM, device=dev, generator=g) * 0.2
    rpw = torch.randn(2 * WINDOW - 1, HEAD_DIM, device=dev, generator=g) * 0.2
    bias = torch.randn(3 * HEADS * HEAD_DIM, device=dev, generator=g) * 0.5
    return tuple(t.to(torch.bfloat16) for t in (qkv, rph, rpw, bias))


def dense_reference(
    qkv: torch.Tensor, rph: torch.Tensor, rpw: torch.Tensor, bias: torch.Tensor,
    heads: int = HEADS,
) -> torch.Tensor:  # fmt: skip
    """Meta's arithmetic in fp32 for the first image: the grid padded to 70 x 70 with
    tokens whose q, k and v are qkv's bias, partitioned into 25 windows, attention with the
    dense decomposed bias in each, unpartitioned and cropped."""
    side = -(-GRID // WINDOW) * WINDOW
    grid = qkv[0].float().view(GRID, GRID, 3, heads, HEAD_DIM)
    padded = bias.float().view(3, heads, HEAD_DIM).expand(side, side, 3, heads, HEAD_DIM)
    padded = padded.clone()
    padded[:GRID, :GRID] = grid
    n = side // WINDOW
    win = padded.view(n, WINDOW, n, WINDOW, 3, heads, HEAD_DIM).permute(0, 2, 1, 3, 4, 5, 6)
    win = win.reshape(n * n, WINDOW * WINDOW, 3, heads, HEAD_DIM)
    q, k, v = win.permute(2, 0, 3, 1, 4).unbind(0)  # [windows, heads, 196, C]
    idx = torch.arange(WINDOW, device=qkv.device)
    rel = idx[:, None] - idx[None, :] + WINDOW - 1
    rh, rw = rph.float()[rel], rpw.float()[rel]  # [14, 14, C]
    r_q = q.reshape(n * n, heads, WINDOW, WINDOW, HEAD_DIM)
    bias_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, rh)
    bias_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, rw)
    dense = (bias_h[..., :, None] + bias_w[..., None, :]).reshape(
        n * n, heads, WINDOW * WINDOW, WINDOW * WINDOW
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # [windows, heads, 196, C]
    out = out.permute(0, 2, 1, 3).reshape(n, n, WINDOW, WINDOW, heads * HEAD_DIM)
    out = out.permute(0, 2, 1, 3, 4).reshape(side, side, heads * HEAD_DIM)
    return out[:GRID, :GRID].reshape(1, GRID * GRID, heads * HEAD_DIM)


def check(batch: int) -> dict[str, Any]:
    qkv, rph, rpw, bias = inputs(batch, seed=1)
    got = launch_gluon_window_attention(qkv, rph, rpw, bias, GRID, GRID)
    torch.cuda.synchronize()
    served = fused_attention.fused_window_attention(qkv, rph, rpw, bias, GRID, GRID)
    ref = dense_reference(qkv, rph, rpw, bias)
    scale = ref.abs().max()
    diff = (got.float() - served.float()).abs()
    row = {
        "batch": batch,
        "gluon vs triton max_rel": float(diff.max() / scale),
        "gluon vs fp32 max_rel (image 0)": float((got[:1].float() - ref).abs().max() / scale),
        "triton vs fp32 max_rel (image 0)": float((served[:1].float() - ref).abs().max() / scale),
        # where the worst token lies: a window at the edge or inside
        "worst token": int(diff.amax(-1).flatten().argmax()) % (GRID * GRID),
        "nan": bool(got.isnan().any()),
        "int8 out max diff": int8_out(
            got,
            lambda inv: launch_gluon_window_attention(
                qkv, rph, rpw, bias, GRID, GRID, out_inv_scale=inv
            ),
        ),
    }
    print(row, flush=True)
    return row


def measure(batch: int, reps: int, iters: int) -> dict[str, Any]:
    qkv, rph, rpw, bias = inputs(batch)
    row: dict[str, Any] = {"batch": batch}
    for name, fn in (
        ("triton ms", lambda: fused_attention.fused_window_attention(
            qkv, rph, rpw, bias, GRID, GRID)),
        ("gluon ms", lambda: launch_gluon_window_attention(qkv, rph, rpw, bias, GRID, GRID)),
    ):  # fmt: skip
        row[name] = graphed_ms(fn, reps, iters)
        print(f"  {name}: {row[name]:.4f}", flush=True)
    row["gluon / triton speed"] = row["triton ms"] / row["gluon ms"]
    return row


def main() -> None:
    def launch_once(batch: int) -> None:
        launch_gluon_window_attention(*inputs(batch), GRID, GRID)

    bench_main(__doc__ or "", lambda: print_resources(compile_for_hopper), launch_once, check,
               measure)  # fmt: skip


if __name__ == "__main__":
    main()
