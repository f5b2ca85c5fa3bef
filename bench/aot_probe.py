"""Does AOTInductor build and load a package on this machine at all? A bf16 Linear, then a
small SDPA block, each exported, packaged and loaded in this process, then compared with
eager. On the GPU image (torch 2.11.0+cu130, H100) torch's own loader (`--raw`) segfaulted
for both: the package's C++ runtime copies met torch's libstdc++ (models.aot.load_package
says why and shares the runtime; docs/BENCHMARKS.md, issue 21).

    PYTHONFAULTHANDLER=1 python3 -m bench.aot_probe [--device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.aot import load_package

aoti_load = torch._inductor.aoti_load_package


class Attention(nn.Module):
    """Self-attention of a tensor with itself: the op SAM's packaged encoder leans on."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


def _show_libraries() -> None:
    """Which C++ runtimes this process has mapped: two copies of libstdc++ would explain a
    crash inside the package's std::regex (a facet from one, the code from the other)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return
    lines = maps.read_text().splitlines()
    seen = sorted({line.split()[-1] for line in lines if "libstdc++" in line})
    print("libstdc++ mapped:", seen, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--raw", dest="share_runtime", action="store_false",
        help="load with torch's own aoti_load_package, not models.aot.load_package",
    )  # fmt: skip
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
            print(name, "built", path, flush=True)
            _show_libraries()
            runner = load_package(Path(path)) if args.share_runtime else aoti_load(path)
            print(name, "loaded", flush=True)
            diff = (runner(x) - module(x)).abs().max().item()
            print(name, "ran; max abs difference from eager", diff, flush=True)


if __name__ == "__main__":
    main()
