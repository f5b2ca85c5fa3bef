"""Where this project's own Triton kernels run: CUDA with Triton installed, and the CPU
under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI, without a GPU, runs
the same kernel source in its tests."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["runs_triton", "triton_installed"]


# found once, at import: a plain constant is what torch.compile traces through without a
# warning (it warned of a functools.cache wrapper when a decoder asked inside the graph)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """Whether Triton is installed here (it ships with CUDA builds of torch)."""
    return _TRITON_INSTALLED


def runs_triton(device: torch.device) -> bool:
    """Whether a kernel launched on `device`'s tensors runs (compiled, or interpreted)."""
    if not triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
