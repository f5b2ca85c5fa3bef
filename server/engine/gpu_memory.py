"""GPU memory as the engine sees it: the gauges its sampler pushes into `Metrics`, and the
pool that keeps long-lived tensors from fragmenting the allocator's cache.

Read in the engine process (the frontends never import torch) and written to the gauges,
which multiprocess mode shares with every frontend's render. The `device` label is the
device's index on the machine: the entry of CUDA_VISIBLE_DEVICES for a torch index when
that is set (one engine per GPU sees its GPU as `cuda:0`), so that two engines never write
the same series, and NVML's own index, which ignores CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from server.metrics import Metrics


class EntryPool:
    """Device memory of its own for what outlives a batch: the embedding cache's entries.

    Why: PyTorch's caching allocator serves a request from the smallest free block that
    fits, in the segments of the stream that asks. An embedding (2 MiB for SAM) cloned at
    the end of an encoder batch is carved out of what that batch's transient tensors (the
    images, the resized batch, tens to hundreds of MB) have just given back, and the cached
    entry then pins that segment: the next batch's transients no longer fit beside it and
    the allocator reserves new segments. While the cache fills, every batch leaves a
    segment behind; an H100 under segment load reserved 52 to 81 GB for 4 to 8 GB allocated
    (docs/BENCHMARKS.md, issue 19). Allocated in a pool of their own, entries share
    segments only with entries: an evicted one's block is the next one's, the stage's
    transients reuse their own blocks, and the reserve stays near the cache's bound plus
    one batch's working set.

    On the CPU (and without CUDA) `allocating` changes nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.MemPool() if device.type == "cuda" else None

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """This thread's device allocations, inside the block, come from the pool."""
        if self._pool is None:
            yield
            return
        # an index-less "cuda" is the current device, which use_mem_pool takes as None
        with torch.cuda.use_mem_pool(self._pool, self.device.index):
            yield

    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the device (0 on the CPU): its segments' sizes."""
        if self._pool is None:
            return 0
        return sum(int(segment["total_size"]) for segment in self._pool.snapshot())


def sample_gpu_memory(metrics: Metrics) -> None:
    """Set the `serve_gpu_*` gauges; nothing at all without CUDA."""
    if not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        metrics.set_gpu_memory(
            device_label(index),
            allocated=torch.cuda.memory_allocated(index),
            reserved=torch.cuda.memory_reserved(index),
            peak=torch.cuda.max_memory_allocated(index),
        )
    for index, used, total in _nvml_memory():
        metrics.set_gpu_device_memory(str(index), used=used, total=total)


def device_label(index: int) -> str:
    """The machine's name for torch's device `index` (see the module docstring)."""
    # Read here, not in Settings: CUDA itself reads it, and the label must agree with it.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    return entries[index] if index < len(entries) else str(index)


def _nvml_memory() -> list[tuple[int, float, float]]:
    """(index, used, total) per device, when nvidia-ml-py is installed; else nothing."""
    try:
        import pynvml  # nvidia-ml-py: optional, present in CUDA images
    except ImportError:
        return []
    # Initialised once per process and left so (the driver's handle costs milliseconds to
    # open, and the sampler asks every few seconds); a failed start is not retried.
    if _nvml_state.get("module") is not pynvml:
        try:
            pynvml.nvmlInit()
            _nvml_state["module"] = pynvml
            _nvml_state["ok"] = True
        except pynvml.NVMLError:
            _nvml_state["module"] = pynvml
            _nvml_state["ok"] = False
    if not _nvml_state["ok"]:
        return []
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            found.append((index, float(info.used), float(info.total)))
        return found
    except pynvml.NVMLError:
        return []


_nvml_state: dict[str, object] = {}
