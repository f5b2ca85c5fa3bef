"""Segment Anything (SAM) for batched inference, written for this service.

Module and parameter names follow Meta's `segment_anything` so its official checkpoints
load as they are; the forward passes are batched over images and over prompt sets, free
of host-device synchronisation, and friendly to `torch.compile` and bf16.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from models.sam.config import SAM_CONFIGS, SamConfig

if TYPE_CHECKING:
    from models.sam.checkpoint import CheckpointError, load_sam
    from models.sam.prompts import PromptBatch, PromptSet, pack_prompts
    from models.sam.sam import Sam

# Imported on first use (PEP 562): the configs need no torch, and the service's frontend
# and supervisor processes read them (settings checks) without loading torch.
_LAZY = {
    "CheckpointError": "models.sam.checkpoint",
    "load_sam": "models.sam.checkpoint",
    "PromptBatch": "models.sam.prompts",
    "PromptSet": "models.sam.prompts",
    "pack_prompts": "models.sam.prompts",
    "Sam": "models.sam.sam",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SAM_CONFIGS",
    "CheckpointError",
    "PromptBatch",
    "PromptSet",
    "Sam",
    "SamConfig",
    "load_sam",
    "pack_prompts",
]
