"""Does AOTInductor build and load a package on this machine at all? A bf16 Linear, then a
small SDPA block, each exported, packaged and loaded in this process, then compared with
eager. On the GPU image (torch 2.11.0+cu130, H100) the load segfaulted for both, which is
why `SERVE_COMPILE_MODE=aot` cannot serve there yet (docs/BENCHMARKS.md, issue 21).

    PYTHONFAULTHANDLER=1 python3 -m bench.aot_probe [--device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Self-attention of a tensor with itself: the op SAM's packaged encoder leans on."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    linear = nn.Linear(64, 64).to(device, dtype)
    cases: list[tuple[str, nn.Module, torch.Tensor]] = [
        ("linear", linear, torch.randn(8, 64, device=device, dtype=dtype)),
        ("sdpa", Attention(), torch.randn(1, 4, 256, 64, device=device, dtype=dtype)),
    ]
    folder = Path(tempfile.mkdtemp(prefix="aot-probe-"))
    for name, module, x in cases:
        with torch.inference_mode():
            exported = torch.export.export(module, (x,))
            path = torch._inductor.aoti_compile_and_package(
                exported, package_path=str(folder / f"{name}.pt2")
            )
            print(name, "built", flush=True)
            runner = torch._inductor.aoti_load_package(path)
            print(name, "loaded", flush=True)
            diff = (runner(x) - module(x)).abs().max().item()
            print(name, "ran; max abs difference from eager", diff, flush=True)


if __name__ == "__main__":
    main()
