"""SAM 2's mask-decoder output on its own: the unfused modules (eager and compiled) against
the fused kernel (`models/sam2/upscale_kernel.py`) at each block size, warp count, channel
step and pipeline depth, for the shapes of segment everything (issue 24; a GPU script, a
smoke test on the CPU).

The tenth session's kernel made the decoder slower (161 ms per photo against 116 in TF32,
docs/BENCHMARKS.md, issue 24's eleventh session). This times the step alone, on one
image's shared skips and P prompt sets, so a change to the kernel is measured in seconds
rather than in a compiled run of the whole generator. Each row gives ms per call and per
photo (`--points` prompt sets per photo), and the largest difference from the unfused
modules in the same precision, with the share of logits whose sign differs (a mask pixel
that flips).

    python3 -m bench.sam2_upscale                                      # on the GPU
    python3 -m bench.sam2_upscale --device cpu --prompts 2 --side 8 --iters 1  # smoke
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.common import cuda_time_ms, environment, print_table, tf32_matmuls
from models.sam.common import LayerNorm2d
from models.triton_device import runs_triton

COLUMNS = ["dtype", "variant", "ms_per_call", "ms_per_photo", "max_diff_rel", "sign_flips"]
DTYPES = {"tf32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}


class Upscale(nn.Module):
    """The decoder's output step with the decoder's module names and shapes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up1, self.norm = nn.ConvTranspose2d(dim, dim // 4, 2, 2), LayerNorm2d(dim // 4)
        self.up2 = nn.ConvTranspose2d(dim // 4, dim // 8, 2, 2)
        with torch.no_grad():  # a norm that is not the identity, as trained ones are not
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)

    def forward(
        self, tokens: Tensor, s1: Tensor, s0: Tensor, hyper: Tensor, h: int, w: int
    ) -> Tensor:
        P, _, D = tokens.shape
        x = tokens.transpose(1, 2).reshape(P, D, h, w)
        x = F.gelu(self.norm(self.up1(x) + s1))
        x = F.gelu(self.up2(x) + s0)
        return (hyper @ x.reshape(P, x.shape[1], -1)).reshape(P, hyper.shape[1], 4 * h, 4 * w)

    def fused(
        self, tokens: Tensor, s1: Tensor, s0: Tensor, hyper: Tensor, h: int, w: int
    ) -> Tensor:
        from models.sam2.upscale_kernel import upscale_masks

        return upscale_masks(
            tokens, self.up1.weight, self.up1.bias, self.norm.weight, self.norm.bias, s1,
            self.up2.weight, self.up2.bias, s0, hyper, h, w, self.norm.eps,
        )  # fmt: skip


def compare(got: Tensor, want: Tensor) -> dict[str, float]:
    diff = (got.float() - want.float()).abs().max().item()
    return {
        "max_diff_rel": diff / max(want.float().abs().max().item(), 1e-12),
        "sign_flips": ((got > 0) != (want > 0)).float().mean().item(),
    }


def bench_dtype(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype, device = DTYPES[name], torch.device(args.device)
    torch.manual_seed(0)
    D, h, w, P = args.dim, args.side, args.side, args.prompts
    module = Upscale(D).to(device, dtype).eval()
    tokens = torch.randn(P, h * w, D, device=device, dtype=dtype)
    s1 = torch.randn(1, D // 4, 2 * h, 2 * w, device=device, dtype=dtype)  # one image's
    s0 = torch.randn(1, D // 8, 4 * h, 4 * w, device=device, dtype=dtype)
    hyper = torch.randn(P, 4, D // 8, device=device, dtype=dtype) / (D // 8) ** 0.5
    inputs = (tokens, s1, s0, hyper, h, w)
    calls_per_photo = args.points / P
    rows = []

    def row(variant: str, fn: Callable[[], Tensor], want: Tensor | None) -> Tensor:
        got = fn()
        ms = cuda_time_ms(fn, args.iters)
        rows.append({
            "dtype": name, "variant": variant, "ms_per_call": ms,
            "ms_per_photo": ms * calls_per_photo,
            **(compare(got, want) if want is not None else {}),
        })  # fmt: skip
        print(rows[-1], flush=True)  # kept if the run is cut short
        return got

    with tf32_matmuls(name == "tf32"), torch.no_grad():
        want = row("eager", lambda: module(*inputs), None)
        if args.compile:
            compiled = torch.compile(module.forward)
            row("compiled", lambda: compiled(*inputs), want)
        if runs_triton(device):
            import models.sam2.upscale_kernel as kernel

            default = (kernel.BLOCK, kernel.NUM_WARPS, kernel.BLOCK_K, kernel.NUM_STAGES)
            try:
                configs = (args.blocks, args.warps, args.block_ks, args.stages)
                for config in itertools.product(*configs):
                    kernel.BLOCK, kernel.NUM_WARPS, kernel.BLOCK_K, kernel.NUM_STAGES = config
                    name = "fused block {} warps {} k {} stages {}".format(*config)
                    row(name, lambda: module.fused(*inputs), want)
            finally:
                kernel.BLOCK, kernel.NUM_WARPS, kernel.BLOCK_K, kernel.NUM_STAGES = default
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["tf32", "bf16"])
    p.add_argument("--prompts", type=int, default=256, help="prompt sets per call")
    p.add_argument("--points", type=int, default=1024, help="prompt sets per photo")
    p.add_argument("--side", type=int, default=64, help="the embedding's side (1024 px: 64)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="source pixels")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--block-ks", type=int, nargs="+", default=[32, 64], help="channels a step")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="pipelined steps")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    print(environment(), flush=True)
    rows = [r for name in args.dtypes for r in bench_dtype(name, args)]
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
