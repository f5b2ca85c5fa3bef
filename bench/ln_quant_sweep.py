"""The quantising layer norm's launch shapes (rows a program, warps) timed against each other
on SAM ViT-B's activations, and against the bytes it must move.

Why: in the served int8 encoder's profile (docs/BENCHMARKS.md, issue 20, nineteenth session)
`layer_norm_quant_kernel` ran its 24 calls a batch of 8 at 39 us each: 76 MB read and written
at about 2 TB/s, under half of what an H200's memory moves. Its shape (4 rows of 1,024 slots,
4 warps) puts a row across every warp, so each of its three row reductions (mean, variance,
absmax) crosses warps through shared memory; fewer warps a row keep them in shuffles. The
first run (H200, 2026-11-29) found every shape within 35-44 us, the served one at 36.8 and
the best 4 rows x 2 warps at 35.1: the reductions' layout is not what holds the kernel at
2 TB/s. Kept to tune the shape on other GPUs and widths.

Each shape's packed rows are compared with the served shape's: `mismatch` counts the int8
values that differ (a reduction in another order can move a value by one step), `max_step`
the largest difference.

    python3 -m bench.ln_quant_sweep
    python3 -m bench.ln_quant_sweep --tokens 64 --iters 2   # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, print_table, write_json
from bench.int8_gemm import CUDA, DEVICE, SAM_DIM, graphed_ms
from models import ln_quant

SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 4), (8, 4), (8, 8), (16, 8)]


def sweep(m: int, c: int, shapes: list[tuple[int, int]], reps: int, iters: int) -> list[dict]:
    """Each shape's time on one `[m, c]` bf16 activation (the served shape's row first)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(m, c, generator=gen) * 2 + 0.5).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(c, generator=gen)).to(DEVICE, torch.bfloat16)
    b = (0.1 * torch.randn(c, generator=gen)).to(DEVICE, torch.bfloat16)
    moved = m * c * x.element_size() + m * (c + ln_quant.PACK_PAD)
    ln_quant.SHAPE = None
    served = ln_quant.launch_shape(1 << (c - 1).bit_length())
    reference = ln_quant.layer_norm_quant(x, w, b, 1e-6, False)
    rows = []
    for shape in [served] + [s for s in shapes if s != served]:
        ln_quant.SHAPE = shape
        try:
            out = ln_quant.layer_norm_quant(x, w, b, 1e-6, False)
            ms = graphed_ms(lambda: ln_quant.layer_norm_quant(x, w, b, 1e-6, False), reps, iters)
        except Exception as exc:  # a shape that does not compile or launch: say so, go on
            rows.append({"m": m, "rows": shape[0], "warps": shape[1], "error": str(exc)[:120]})
            continue
        finally:
            ln_quant.SHAPE = None
        step = (out[:, :c].int() - reference[:, :c].int()).abs()
        rows.append({
            "m": m, "rows": shape[0], "warps": shape[1], "served": shape == served,
            "us": ms * 1000, "gb_per_s": moved / ms / 1e6,
            "mismatch": int((step > 0).sum()), "max_step": int(step.max()),
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", nargs="+", type=int, default=[8 * 4096, 16 * 4096])
    p.add_argument("--reps", type=int, default=20, help="calls a CUDA graph replays")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    rows: list[dict[str, Any]] = []
    for m in args.tokens:
        rows += sweep(m, SAM_DIM, SHAPES, args.reps if CUDA else 1, args.iters)
    write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, C = {SAM_DIM}")
    cols = ["m", "rows", "warps", "served", "us", "gb_per_s", "mismatch", "max_step", "error"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
