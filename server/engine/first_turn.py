"""The engines of a host warm a quantised model's bucket one first, the rest after it.

Why: int8 and fp8 GEMMs choose their tile configuration by timing candidates on the GPU
(Triton's autotuner, its choices kept in the compile cache: `models/gemm_kernel.py`), and
inductor compiles each bucket's graph on the host's cores. Six engines starting together
on one H200 did all of that six times at once, each on a GPU and 16 cores the other five
were using: each spent 110 s on int8 Swin's first batch size, and the service was not
ready in 330 s (docs/BENCHMARKS.md, issue 20). Timings taken under that contention also
choose configurations by noise.

So the first engine to reach such a bucket warms it alone while the others wait; it
leaves a mark beside its caches, and the others, finding the mark, warm from the caches
it filled, all at once again. A restart that keeps the caches (`SERVE_COMPILE_CACHE_DIR`)
keeps the marks, and nobody waits. A lock held by an engine that dies is released by the
kernel with its file, and the mark is only left by a warm-up that finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["first_turn", "first_turn_folder", "first_turn_key"]


def first_turn_folder(compile_cache_dir: Path | None) -> Path:
    """Where the locks and marks live: beside the caches the engines share (the compile
    cache folder, else torch's and Triton's per-user defaults on this host). By user id:
    a pod may run as one that has no name."""
    if compile_cache_dir is not None:
        return compile_cache_dir / "first-turn"
    return Path(tempfile.gettempdir()) / f"serve-first-turn-{os.getuid()}"


def first_turn_key(
    stage: str,
    bucket: int,
    device: torch.device,
    quantization: str,
    model: str,
    compile_mode: str,
) -> str | None:
    """What one engine warms for all: a quantised stage's bucket on a GPU (what the
    autotuner times). None where engines gain nothing by waiting: unquantised stages, whose
    compiled kernels are not tuned by timing (inductor's default mode), and the CPU."""
    if device.type != "cuda" or quantization == "none":
        return None
    import triton

    gpu = torch.cuda.get_device_name(device)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    return f"{stage} {model} {quantization} batch {bucket} {compile_mode} on {gpu}, {versions}"


@contextmanager
def first_turn(folder: Path, key: str) -> Iterator[bool]:
    """Hold the body until no other process is warming `key`; yields True when this
    process warms it first (the others wait until the body has finished), False when an
    earlier one already did (the body runs at once, beside any others)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    done = folder / f"{name}.done"
    with open(folder / f"{name}.lock", "a+b") as handle:
        started = time.perf_counter()
        fcntl.flock(handle, fcntl.LOCK_EX)
        waited = time.perf_counter() - started
        if done.exists():
            fcntl.flock(handle, fcntl.LOCK_UN)
            if waited > 1.0:
                log.info("%s: warmed from the caches another engine filled (waited %.1fs)",
                         key, waited)  # fmt: skip
            yield False
            return
        log.info("%s: warming first; the host's other engines wait for it", key)
        try:
            yield True
            done.write_text(key + "\n")  # only after a warm-up that finished
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
