"""Where this project's own Triton kernels run: CUDA with Triton installed, and the CPU
under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI, without a GPU, runs
the same kernel source in its tests."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["runs_triton", "triton_installed"]


@functools.cache
def triton_installed() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_triton(device: torch.device) -> bool:
    """Whether a kernel launched on `device`'s tensors runs (compiled, or interpreted)."""
    if not triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
