"""Segment Anything (SAM) for batched inference, written for this service.

Module and parameter names follow Meta's `segment_anything` so its official checkpoints
load as they are; the forward passes are batched over images and over prompt sets, free
of host-device synchronisation, and friendly to `torch.compile` and bf16.
"""

from models.sam.checkpoint import CheckpointError, load_sam
from models.sam.config import SAM_CONFIGS, SamConfig
from models.sam.prompts import PromptBatch, PromptSet, pack_prompts
from models.sam.sam import Sam

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
