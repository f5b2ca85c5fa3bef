"""Shared pieces of the GPU benchmark scripts: timing, images, reporting.

Benchmarks are scripts, never timed tests: they run on a GPU, print a table last, and
their figures go to docs/BENCHMARKS.md with date, GPU, torch version and command.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from models import fidelity

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
    """The photos in `folder` as uint8 `[H, W, 3]` tensors (`models.fidelity.load_photos`,
    which the service's fidelity check reads too); none there ends the script."""
    try:
        return fidelity.load_photos(folder)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{exc} (pass --images)") from None


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


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """fp32 matmuls on TF32 tensor cores (`set_float32_matmul_precision("high")`) while
    inside; convolutions already are by PyTorch's default (`cudnn.allow_tf32`), on both
    sides."""
    before = torch.get_float32_matmul_precision()
    if enabled:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# SAM 2's decoder paths (`Sam2.use_decoder_paths`), flags of bench.sam2 and
# bench.everything_stages, each --x or --no-x, by default what the service picks for the
# device (`models.sam2.model.default_decoder_paths`): (flag, help)
DECODER_PATHS = (
    ("--fused-upscale", "the decoder's output in one kernel (models/sam2/upscale_kernel.py)"),
    ("--fused-attention", "the decoder's attention in one kernel (decoder_attention_kernel.py)"),
    ("--share-image", "the decoder's first layer on one row of image tokens (Sam2.share_image)"),
)


def add_decoder_path_flags(parser: argparse.ArgumentParser) -> None:
    for flag, text in DECODER_PATHS:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None,
            help=f"SAM 2: {text} (default: as the service on this device)",
        )  # fmt: skip


def decoder_paths(args: argparse.Namespace) -> dict[str, bool]:
    """`Sam2.use_decoder_paths`' arguments: each flag given, else the service's default."""
    from models.sam2.model import default_decoder_paths

    paths = default_decoder_paths(torch.device(args.device))
    for name in paths:
        given = getattr(args, name)
        if given is not None:
            paths[name] = given
    return paths


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
