"""Where this project's own Triton kernels run: CUDA with Triton installed, and the CPU
under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI, without a GPU, runs
the same kernel source in its tests."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["gluon_unsupported", "runs_triton", "triton_installed"]


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


def gluon_unsupported(device: torch.device) -> str | None:
    """Why the warp-specialised Gluon kernels (models/gemm_gluon.py,
    models/sam/gluon_attention.py, models/sam/gluon_window_attention.py) cannot run on
    `device`, or None. They are written for Hopper's wgmma, TMA and register reallocation,
    in Triton's Gluon, which some Triton builds lack; no interpreter runs them."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not triton_installed():
        return "Triton is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"{name} is compute capability {major}.{minor}; the kernels are Hopper's (9.0)"
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no Gluon for Hopper ({exc})"
    return None
