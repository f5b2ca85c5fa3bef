"""SAM 2.1's image path in plain PyTorch (Hiera + FPN encoder, SAM 2 mask decoder), loading
Meta's official checkpoints. The video memory modules are not implemented."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from models.sam2.config import SAM2_CONFIGS, Sam2Config

if TYPE_CHECKING:
    from models.sam2.checkpoint import Sam2CheckpointError, load_sam2
    from models.sam2.model import (
        Sam2,
        Sam2Encoder,
        Sam2Features,
        Sam2Prediction,
        default_decoder_paths,
    )

__all__ = [
    "SAM2_CONFIGS",
    "Sam2",
    "Sam2CheckpointError",
    "Sam2Config",
    "Sam2Encoder",
    "Sam2Features",
    "Sam2Prediction",
    "default_decoder_paths",
    "load_sam2",
]

# Imported on first use (PEP 562), as models.sam does: the configs need no torch, and the
# frontend and supervisor processes read them (settings checks) without loading torch.
_LAZY = {
    "Sam2CheckpointError": "models.sam2.checkpoint",
    "load_sam2": "models.sam2.checkpoint",
    "Sam2": "models.sam2.model",
    "Sam2Encoder": "models.sam2.model",
    "Sam2Features": "models.sam2.model",
    "Sam2Prediction": "models.sam2.model",
    "default_decoder_paths": "models.sam2.model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
