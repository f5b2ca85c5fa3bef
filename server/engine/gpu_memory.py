"""GPU memory as the engine sees it, pushed into `Metrics` by its sampler, and its caching
allocator's pools by stream, for the log (`kill -USR2` an engine).

Read in the engine process (the frontends never import torch) and written to the gauges,
which multiprocess mode shares with every frontend's render. The `device` label is the
device's index on the machine: the entry of CUDA_VISIBLE_DEVICES for a torch index when
that is set (one engine per GPU sees its GPU as `cuda:0`), so that two engines never write
the same series, and NVML's own index, which ignores CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from server.metrics import Metrics


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


def memory_by_stream(streams: Mapping[str, torch.cuda.Stream]) -> list[dict[str, object]]:
    """The caching allocator's segments summed per stream (and private pool: a CUDA graph's):
    which stage holds the device's reserve, and how fragmented it is (its largest free
    block beside what it reserves). Walks every block of the allocator's snapshot, holding
    the GIL for milliseconds: for a signal or a bench, not for every metrics sample.

    `streams` names the stages' streams; 0 is the default stream, where the event loop and
    the JPEG thread allocate. Sizes in MB (10^6 bytes)."""
    names = {int(stream.cuda_stream): stage for stage, stream in streams.items()}
    return summarize_segments(torch.cuda.memory_snapshot(), names)


def summarize_segments(
    segments: list[dict[str, Any]], names: Mapping[int, str]
) -> list[dict[str, object]]:
    """`memory_by_stream`'s sums over segments in the format of torch.cuda.memory_snapshot()
    (streams named by `names`, 0 as "default"), the largest reserve first."""
    names = {0: "default", **names}
    rows: dict[str, dict[str, float]] = {}
    for segment in segments:
        name = names.get(int(segment["stream"]), hex(int(segment["stream"])))
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            name = f"{name}, pool {pool[0]}.{pool[1]}"
        row = rows.setdefault(
            name, {"segments": 0, "reserved_mb": 0.0, "allocated_mb": 0.0, "free_blocks": 0,
                   "largest_free_mb": 0.0, "largest_segment_mb": 0.0},
        )  # fmt: skip
        row["segments"] += 1
        row["reserved_mb"] += segment["total_size"] / 1e6
        row["allocated_mb"] += segment["allocated_size"] / 1e6
        row["largest_segment_mb"] = max(row["largest_segment_mb"], segment["total_size"] / 1e6)
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                row["free_blocks"] += 1
                row["largest_free_mb"] = max(row["largest_free_mb"], block["size"] / 1e6)
    ordered = sorted(rows.items(), key=lambda kv: -kv[1]["reserved_mb"])
    return [
        {"pool": name, **{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}}
        for name, row in ordered
    ]


def record_history(entries: int) -> None:
    """Record the allocator's latest `entries` events (allocations, frees, segment mallocs)
    with the Python stack of each (`SERVE_GPU_MEMORY_HISTORY`): what `dump_history` writes.
    Set before the models load, so their segments are in it too."""
    torch.cuda.memory._record_memory_history(
        "all", context="all", stacks="python", max_entries=entries
    )


def dump_history() -> str:
    """The recorded events and the allocator's segments, as a pickle that PyTorch's memory
    viz (pytorch.org/memory_viz) or `torch.cuda._memory_viz` reads; returns its path."""
    path = os.path.join(
        tempfile.gettempdir(), f"gpu-memory-{os.getpid()}-{time.strftime('%H%M%S')}.pickle"
    )
    torch.cuda.memory._dump_snapshot(path)
    return path
