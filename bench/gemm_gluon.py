"""The warp-specialised Gluon int8 GEMM (models/gemm_gluon.py) beside the served persistent
Triton kernel (models/gemm_persistent.py) and bf16 (cuBLAS), on SAM ViT-B's encoder
products as the served int8 encoder (`SERVE_QUANTIZATION=int8`) runs them.

Why: the int8 GEMMs are 6 of a batch's 16 ms in that encoder and run at 40-50% of
Hopper's int8 rate; the Gluon kernel overlaps one warp group's epilogue with the other's
main loop (issue 20). Each product, with its epilogue as served, is timed inside a CUDA
graph of `--reps` calls:

- `qkv`: the quantising norm's packed rows (each row K + 16 bytes apart), a scale per row,
  bias, bf16 out;
- `proj`: a scale per row, bias, the residual added, bf16 out;
- `lin1`: packed rows, bias, GELU (tanh form), int8 out by fixed per-column scales;
- `lin2`: its input quantised by fixed scales folded into the weight (no scale per row),
  bias, the residual, bf16 out.

`max_rel` compares the Gluon kernel's output with the persistent kernel's (their
arithmetic is the same, in the same order; bf16 rounding and FMA contraction may differ),
relative to the output's largest magnitude; for int8 outputs, the share of values that
differ and the largest difference in steps.

    python3 -m bench.gemm_gluon --batch 8
    python3 -m bench.gemm_gluon --check-only  # its numbers on odd shapes against torch
    python3 -m bench.gemm_gluon --configs s4 --ceilings  # and what bounds each product
    python -m bench.gemm_gluon --resources    # no GPU: each form compiled for sm_90
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, write_json
from bench.int8_gemm import SAM_TOKENS, graphed_ms
from bench.int8_persistent import sam_products
from models.gemm_gluon import GluonConfig, launch_gluon
from models.gemm_persistent import (
    launch_persistent,
    launch_persistent_static_out,
    served_config,
)
from models.int8_gemm import quantize_rows
from models.ln_quant import pack_rows

CONFIGS = {
    "s4": GluonConfig(128, 128, 128, 4),
    "s3": GluonConfig(128, 128, 128, 3),
    "k64s6": GluonConfig(128, 128, 64, 6),
    # both consumer groups on one 128 x 256 tile (the A rows shared): 3 slots fit
    "coop3": GluonConfig(128, 128, 128, 3, coop=True),
    "coop4": GluonConfig(128, 128, 128, 4, coop=True),  # int8 outputs only (lin1): 224 KiB
}


class Form(NamedTuple):
    """How the served int8 encoder launches one kind of product."""

    x_scaled: bool  # a scale per row (lin2's input is scaled by fixed scales in its weight)
    bias: bool
    residual: bool
    gelu: int  # 0 none, 2 the tanh form (gemm_persistent's GELU codes)
    int8_out: bool  # int8 by fixed per-column scales (lin1's output, lin2's input)
    packed: bool  # the input as the quantising norm writes it (rows K + 16 bytes apart)


FORMS = {
    "qkv": Form(True, True, False, 0, False, True),
    "proj": Form(True, True, True, 0, False, False),
    "lin1": Form(True, True, False, 2, True, True),
    "lin2": Form(False, True, True, 0, False, False),
}


def compile_for_hopper(form: str, config: GluonConfig | None = None) -> Any:
    """One of `FORMS` compiled for sm_90 by this machine's Triton (no GPU needed), as
    `launch_gluon` would launch it on a SAM-sized product."""
    from bench.gemm_resources import compile_gluon, gluon_descriptor
    from models import gemm_gluon

    c = config or GluonConfig()
    f = FORMS[form]
    out = torch.int8 if f.int8_out else torch.bfloat16

    def desc(dtype: torch.dtype, block: list[int]) -> str:
        return gluon_descriptor(256, 256, dtype, block, gemm_gluon._layout(block, dtype))

    signature = {
        "a_desc": desc(torch.int8, [c.block_m, c.block_k]),
        "b_desc": desc(torch.int8, [c.tile_n, c.block_k]),
        "c_desc": desc(out, [c.block_m, c.block_n]),
        "r_desc": desc(out, [c.block_m, c.block_n]),
        "XS": "*fp32", "WS": "*fp32", "BIAS": "*fp32", "OS": "*fp32",
        "M": "i32", "N": "i32", "K": "i32", "stride_xs": "i32", "num_programs": "i32",
    }  # fmt: skip
    constexprs = {"X_SCALED": f.x_scaled, "HAS_BIAS": f.bias, "HAS_RES": f.residual,
                  "GELU": f.gelu, "IS_FP8": False, "QUANT_OUT": f.int8_out, "GROUP_M": 8,
                  "STAGES": c.stages, "CONSUMER_REGS": c.consumer_registers,
                  "PRODUCER_REGS": gemm_gluon.PRODUCER_REGISTERS, "COOP": c.coop}  # fmt: skip
    return compile_gluon(gemm_gluon._kernel(), signature, constexprs,
                         gemm_gluon.KERNEL_MAX_REGISTERS, divisible=("N", "K"))  # fmt: skip


def print_resources() -> None:
    import triton

    from bench.gemm_resources import resources, setmaxnreg

    rows = []
    for form in FORMS:
        compiled = compile_for_hopper(form)
        budgets = sorted(setmaxnreg(compiled.asm["ptx"]))
        rows.append({"form": form, **resources(compiled),
                     "setmaxnreg": " ".join(f"{d} {n}" for d, n in budgets)})  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\nTriton {triton.__version__}, sm_90")
    print_table(rows, list(rows[0]))


# small products whose last row tile is partial, each served form once: run before any
# timing, against the arithmetic in torch (the int32 product by torch._int_mm)
CHECKS = [(300, 768, 768, "qkv"), (1000, 768, 2304, "proj"), (4100, 768, 3072, "lin1"),
          (4100, 3072, 768, "lin2")]  # fmt: skip


def check(configs: list[str] | None = None) -> list[dict[str, Any]]:
    """Each of `CHECKS` through `launch_gluon` in each of `configs` (the default config
    alone: None) against torch: `max_rel` for bf16 outputs (the largest difference over the
    largest magnitude), the share of int8 outputs off by a step and the largest step for
    lin1's. A config whose shared memory a form overflows is left out of that form."""
    from triton.runtime.errors import OutOfResources

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    names: list[str | None] = [*configs] if configs else [None]
    for (m, k, n, form), name in itertools.product(CHECKS, names):
        f = FORMS[form]
        xq, xs = quantize_rows(torch.randn(m, k, device=dev, generator=g))
        wq, ws = quantize_rows(torch.randn(n, k, device=dev, generator=g) / k**0.5)
        bias = torch.randn(n, device=dev, generator=g) * 0.1
        res = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16) if f.residual else None
        y = torch._int_mm(xq, wq.t()).float()
        y = (y * xs[:, None] if f.x_scaled else y) * ws[None, :] + bias
        y = F.gelu(y, approximate="tanh") if f.gelu else y
        y = y + res.float() if res is not None else y
        inv = 127.0 / y.abs().amax(0) if f.int8_out else None
        try:
            got = launch_gluon(xq, xs if f.x_scaled else None, wq, ws, bias, res,
                               gelu=bool(f.gelu), gelu_tanh=True, out_inv_scale=inv,
                               config=CONFIGS[name] if name else None)  # fmt: skip
        except OutOfResources as exc:
            print(f"  {form} {name}: {str(exc)[:120]}", flush=True)
            continue
        row: dict[str, Any] = {"form": form, "config": name or "default", "M": m, "K": k, "N": n}
        if inv is not None:
            step = (got.int() - (y * inv).round().clamp(-127, 127).int()).abs()
            row |= {"int8 differ": float((step > 0).float().mean()), "max step": int(step.max())}
        else:
            row["max_rel"] = float((got.float() - y).abs().max() / y.abs().max())
        print(row, flush=True)
        rows.append(row)
    return rows


def products(batch: int) -> list[dict[str, Any]]:
    """SAM ViT-B's block products at `batch`, as bench.int8_persistent lists them."""
    return [{k: r[k] for k in ("layer", "M", "K", "N")}
            for r in sam_products(batch, SAM_TOKENS) if "~" not in r["layer"]]  # fmt: skip


def ceilings(
    row: dict[str, Any],
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    reps: int,
    iters: int,
) -> None:
    """What bounds the product, beside the served forms: the same operands through the Gluon
    kernel with no epilogue work (no scales, bias, residual or GELU; bf16 out: its main loop
    and store alone), cuBLASLt's int8 product (`torch._int_mm`, int32 out, contiguous rows)
    and the vendor's fp8 rowwise product on e4m3 copies (`torch._scaled_mm`, CUTLASS on
    sm_90, scales and bf16 out in its epilogue)."""
    flops = 2 * row["M"] * row["K"] * row["N"]
    dense = xq.contiguous()
    a8 = (dense.float() / 127 * 448).to(torch.float8_e4m3fn)
    b8 = (wq.float() / 127 * 448).to(torch.float8_e4m3fn)
    forms: dict[str, Any] = {
        "gluon bare": lambda: launch_gluon(xq, None, wq, ws.new_ones(ws.shape)),
        "int_mm": lambda: torch._int_mm(dense, wq.t()),
        "fp8 rowwise": lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=xs.float()[:, None].contiguous(),
            scale_b=ws.float()[None, :].contiguous(), out_dtype=torch.bfloat16),
    }  # fmt: skip
    for name, fn in forms.items():
        try:
            ms = graphed_ms(fn, reps, iters)
        except Exception as exc:  # a form this torch or device lacks: say so, go on
            print(f"  {row['layer']} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        row[f"{name} ms"] = ms
        row[f"{name} TFLOP/s"] = flops / ms / 1e9


def measure(
    row: dict[str, Any], configs: list[str], reps: int, iters: int, with_ceilings: bool = False
) -> None:
    m, k, n = row["M"], row["K"], row["N"]
    layer = row["layer"].split(".")[1]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, generator=g) / k**0.5
    bias = torch.randn(n, device=dev, generator=g) * 0.1
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    res = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
    wb, bb = w.to(torch.bfloat16), bias.to(torch.bfloat16)
    form = FORMS[layer]
    if form.packed:
        xq = pack_rows(xq, xs)[:, :k]
    kw: dict[str, Any] = {}
    x_scale = xs if form.x_scaled else None
    residual = res if form.residual else None
    if form.int8_out:
        y = F.gelu(F.linear(x.float(), w, bias), approximate="tanh")
        kw = {"gelu": True, "gelu_tanh": True, "out_inv_scale": 127.0 / y.abs().amax(0)}

    def persistent() -> torch.Tensor:
        if form.int8_out:
            return launch_persistent_static_out(
                xq, x_scale, wq, ws, bias, config=served_config(False, True), **kw
            )
        return launch_persistent(xq, x_scale, wq, ws, bias, residual,
                                 config=served_config(residual is not None))  # fmt: skip

    def gluon(cfg: GluonConfig) -> torch.Tensor:
        return launch_gluon(xq, x_scale, wq, ws, bias, residual, config=cfg, **kw)

    def bf16() -> torch.Tensor:
        if form.gelu:
            return torch._addmm_activation(bb, x, wb.t(), use_gelu=True)
        y = F.linear(x, wb, bb)
        return y + residual if residual is not None else y

    flops = 2 * m * k * n
    if with_ceilings:
        ceilings(row, xq, xs, wq, ws, reps, iters)
    row["bf16 ms"] = graphed_ms(bf16, reps, iters)
    row["persistent ms"] = graphed_ms(persistent, reps, iters)
    want = persistent()
    for name in configs:
        try:
            ms = graphed_ms(functools.partial(gluon, CONFIGS[name]), reps, iters)
        except Exception as exc:  # a shape that does not fit or compile: say so, go on
            print(f"  {row['layer']} gluon {name}: {type(exc).__name__}: {str(exc)[:200]}",
                  flush=True)  # fmt: skip
            continue
        got = gluon(CONFIGS[name])
        row[f"gluon {name} ms"] = ms
        row[f"gluon {name} TFLOP/s"] = flops / ms / 1e9
        if got.dtype == torch.int8:
            diff = (got.int() - want.int()).abs()
            row[f"{name} int8 differ"] = float((diff > 0).float().mean())
            row[f"{name} int8 max step"] = int(diff.max())
        else:
            row[f"{name} max_rel"] = float(
                (got.float() - want.float()).abs().max() / want.float().abs().max()
            )
        print(f"  {row['layer']} gluon {name}: {ms:.4f} ms", flush=True)
    row["persistent TFLOP/s"] = flops / row["persistent ms"] / 1e9
    best = min((row[f"gluon {c} ms"] for c in configs if f"gluon {c} ms" in row), default=None)
    if best is not None:
        row["best gluon / persistent"] = row["persistent ms"] / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--layers", nargs="+", default=None, help="e.g. global.lin1 window.qkv")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--resources", action="store_true", help="compile each form for sm_90 only")
    p.add_argument("--check-only", action="store_true", help="the numbers of `CHECKS` only")
    p.add_argument(
        "--ceilings",
        action="store_true",
        help="also the kernel without epilogue work, torch._int_mm, fp8 rowwise",
    )
    args = p.parse_args()
    if args.resources:
        print_resources()
        return
    if not torch.cuda.is_available():
        raise SystemExit("the Gluon GEMM runs only on a Hopper GPU")
    env = environment()
    print(env, flush=True)
    checks = check(args.configs)
    columns = ("form", "config", "M", "K", "N", "max_rel", "int8 differ", "max step")
    print_table(checks, [c for c in columns if any(c in r for r in checks)])
    if args.check_only:
        return
    rows = [r for r in products(args.batch) if args.layers is None or r["layer"] in args.layers]
    for row in rows:
        measure(row, args.configs, args.reps, args.iters, args.ceilings)
        print(row, flush=True)
    total: dict[str, Any] = {"layer": "both blocks (sum)"}
    for key in ["bf16 ms", "persistent ms"] + [f"gluon {c} ms" for c in args.configs]:
        if all(key in r for r in rows):
            total[key] = sum(r[key] for r in rows)
    rows.append(total)
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, batch {args.batch}")
    cols = ["layer", "M", "K", "N", "bf16 ms", "persistent ms", "persistent TFLOP/s"]
    for c in args.configs:
        cols += [f"gluon {c} ms", f"gluon {c} TFLOP/s", f"{c} max_rel", f"{c} int8 differ",
                 f"{c} int8 max step"]  # fmt: skip
    cols.append("best gluon / persistent")
    for name in ("gluon bare", "int_mm", "fp8 rowwise"):
        cols += [f"{name} ms", f"{name} TFLOP/s"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    if args.json:
        write_json(Path(args.json), {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
