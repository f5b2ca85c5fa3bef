"""GPU memory as the engine sees it, pushed into `Metrics` by its sampler.

Read in the engine process (the frontends never import torch) and written to the gauges,
which multiprocess mode shares with every frontend's render. The `device` label is the
device's index on the machine: the entry of CUDA_VISIBLE_DEVICES for a torch index when
that is set (one engine per GPU sees its GPU as `cuda:0`), so that two engines never write
the same series, and NVML's own index, which ignores CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os

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
