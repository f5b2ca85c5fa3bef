"""Swin's blocks one by one: the written-out window attention against the kernel
(`models/swin/window_kernel.py`) at each warp count, compiled, in CUDA graphs (issue 20;
a GPU script, a smoke test on the CPU).

A Swin-T block per stage (plain and shifted windows), on a batch of normed-size token grids:
ms per block call for each form, and the kernel's largest difference from the written-out
block in the same precision. `bench/swin.py --attention auto matmul` then measures the
whole classifier.

    python3 -m bench.swin_window_kernel                                         # on the GPU
    python3 -m bench.swin_window_kernel --device cpu --batch 1 --iters 1 --no-compile  # smoke
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import models.swin.window_kernel as window_kernel
from bench.common import cuda_time_ms, environment, print_table
from models.swin import SWIN_CONFIGS
from models.swin.model import SwinBlock
from models.triton_device import runs_triton

COLUMNS = ["stage", "shifted", "form", "ms", "max_diff_rel"]


def block_rows(stage: int, shifted: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    config = SWIN_CONFIGS[args.model]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(stage)
    block = SwinBlock(config, stage, shifted)
    with torch.no_grad():  # a bias that matters (a fresh table is zeros)
        block.attn.relative_position_bias_table.normal_(0, 1)
    block = block.to(device, dtype).eval()
    block.reset_constant_buffers(device)
    if block.attn_mask is not None:
        block.attn_mask = block.attn_mask.to(dtype)
    res, dim = config.stage_resolutions[stage], config.stage_dims[stage]
    x = torch.randn(args.batch, res, res, dim, device=device, dtype=dtype)
    rows: list[dict[str, Any]] = []

    def row(form: str, fn: Callable[[], Tensor], want: Tensor | None) -> Tensor:
        got = fn().clone()
        ms = cuda_time_ms(fn, args.iters) if device.type == "cuda" else float("nan")
        diff = None
        if want is not None:
            scale = want.float().abs().max().item()
            diff = (got.float() - want.float()).abs().max().item() / max(scale, 1e-12)
        rows.append({"stage": stage, "shifted": shifted, "form": form, "ms": ms,
                     "max_diff_rel": diff})  # fmt: skip
        print(rows[-1], flush=True)  # kept if the run is cut short
        return got

    def runner(form: str) -> Callable[[], Tensor]:
        block.attn.form = form
        fn = torch.compile(block, fullgraph=True) if args.compile else block
        with torch.inference_mode():
            fn(x)  # compiled now, with this form

        def call() -> Tensor:
            with torch.inference_mode():
                return fn(x)

        return call

    want = row("matmul", runner("matmul"), None)
    torch._dynamo.reset()
    if runs_triton(device):
        default = window_kernel.WindowKernelConfig.num_warps
        try:
            for warps in args.warps:
                window_kernel.WindowKernelConfig.num_warps = warps
                row(f"kernel, {warps} warps", runner("kernel"), want)
                torch._dynamo.reset()
        finally:
            window_kernel.WindowKernelConfig.num_warps = default
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="swin_tiny_patch4_window7_224", choices=list(SWIN_CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    print(environment(), flush=True)
    config = SWIN_CONFIGS[args.model]
    rows = []
    for stage in range(config.num_stages):
        shifts = [False, True] if config.stage_shift_size(stage) else [False]
        for shifted in shifts:
            rows += block_rows(stage, shifted, args)
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
