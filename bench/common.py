"""Shared pieces of the GPU benchmark scripts: timing, images, reporting.

Benchmarks are scripts, never timed tests: they run on a GPU, print a table last, and
their figures go to docs/BENCHMARKS.md with date, GPU, torch version and command.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

DEFAULT_IMAGES = Path(__file__).resolve().parents[2] / "shared" / "data" / "images"


def environment() -> dict[str, Any]:
    """What a result row must carry to be comparable: device, torch, date."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def load_photos(folder: Path) -> list[torch.Tensor]:
    """Every .jpg in `folder` as uint8 `[H, W, 3]` tensors, sorted by name."""
    paths = sorted(folder.glob("*.jpg"))
    if not paths:
        raise SystemExit(f"no .jpg photos in {folder} (pass --images)")
    return [torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()) for p in paths]


def host_time_ms(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn` over `iters` runs by the host clock (host-side work)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` over `iters` runs, timed with CUDA events.

    Without CUDA (a smoke run of a script on the CPU) the host clock times it instead.
    """
    if not torch.cuda.is_available():
        return host_time_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-30))


def mask_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU per mask of two bool stacks `[N, H, W]` (1.0 where both are empty)."""
    inter = (a & b).flatten(1).sum(1).double()
    union = (a | b).flatten(1).sum(1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def peak_gib() -> float:
    """Peak bytes held by tensors since the last reset, in GiB (0 without CUDA)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str))
