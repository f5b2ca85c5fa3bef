"""SAM's attention kernel under Nsight Compute: where its warps stall, by instruction.

Why: timings say how long a launch shape takes, not why. On the H200 (Firecracker) `ncu`
reads the hardware counters; this launches each shape once for it to profile
(`launch`), then reduces the report's per-instruction source counters to the kernel's
stall reasons and its top stalled SASS lines (`stalls`). It found that the global
layer's kernel ran two programs an SM, held back by registers (docs/BENCHMARKS.md, issue
20's thirteenth session).

    ncu --clock-control none --set full --import-source yes -k regex:rel_pos -o attn \
        python3 -m bench.ncu_attention launch
    ncu -i attn.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m bench.ncu_attention stalls sass.csv
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"
# (batch, grid side, register cap): a global layer and a windowed one of ViT-B at batch
# 8, as KernelConfig runs them, and the global one uncapped
SHAPES = [(8, 64, 168), (8, 64, None), (200, 14, None)]


def launch(shapes: list[tuple[int, int, int | None]]) -> None:
    import torch

    from models.sam.fused_attention import KernelConfig, launch

    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, side, maxnreg in shapes:
        width = max(16, 1 << (side - 1).bit_length())
        KernelConfig.maxnreg = {(width, 64): maxnreg} if maxnreg else {}
        shape = (batch, 12, side * side, 64)
        q, k, v = (_randn(g, *shape) for _ in "qkv")
        rph, rpw = (_randn(g, 2 * side - 1, 64) * 0.1 for _ in "hw")
        launch(q, k, v, rph, rpw)
    torch.cuda.synchronize()


def _randn(g: Any, *shape: int) -> Any:
    import torch

    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


def _as_int(text: str) -> int:
    return int(text) if text.isdigit() else 0


def stalls(path: Path, top: int) -> list[dict[str, object]]:
    """Per kernel in the CSV (`ncu --page source --csv --print-source sass`): the share of
    each stall reason over all samples, and the `top` instructions by samples."""
    with path.open() as f:
        rows = list(csv.reader(f))
    kernels: list[list[list[str]]] = []
    for r in rows:
        if r and r[0] == "Kernel Name":
            kernels.append([])
        elif kernels:
            kernels[-1].append(r)
    out = []
    for body in kernels:
        header, data = body[0], body[1:]
        col = {h: i for i, h in enumerate(header)}
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(_as_int(r[col[SAMPLES]]) for r in data) or 1
        by_reason = Counter({h[6:]: sum(_as_int(r[col[h]]) for r in data) for h in reasons})
        # samples no stall_ column names (4% of one kernel's): counted, not dropped
        by_reason["other"] = max(0, total - sum(by_reason.values()))
        hot = sorted(data, key=lambda r: -_as_int(r[col[SAMPLES]]))[:top]
        out.append(
            {
                "samples": total,
                "reasons": {k: round(100 * v / total, 1) for k, v in by_reason.most_common() if v},
                "top": [
                    {
                        "share": round(100 * _as_int(r[col[SAMPLES]]) / total, 1),
                        "sass": r[col["Source"]].strip(),
                        "why": max(reasons, key=lambda h: _as_int(r[col[h]]))[6:],
                    }
                    for r in hot
                ],
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("launch", help="launch each shape once (run under ncu)")
    s = sub.add_parser("stalls", help="summarise ncu's per-instruction CSV")
    s.add_argument("csv", type=Path)
    s.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if args.cmd == "launch":
        launch(SHAPES)
        return
    for i, kernel in enumerate(stalls(args.csv, args.top)):
        reasons = dict(list(kernel["reasons"].items())[:8])  # type: ignore[attr-defined]
        print(f"kernel {i}: {kernel['samples']} samples, stall reasons (%) {reasons}")
        for line in kernel["top"]:  # type: ignore[attr-defined]
            print(f"  {line['share']:5.1f}%  {line['sass'][:64]:64s}  {line['why']}")


if __name__ == "__main__":
    main()
