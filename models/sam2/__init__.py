"""SAM 2.1's image path in plain PyTorch (Hiera + FPN encoder, SAM 2 mask decoder), loading
Meta's official checkpoints. The video memory modules are not implemented."""

from models.sam2.checkpoint import Sam2CheckpointError, load_sam2
from models.sam2.config import SAM2_CONFIGS, Sam2Config
from models.sam2.model import Sam2, Sam2Features, Sam2Prediction

__all__ = [
    "SAM2_CONFIGS",
    "Sam2",
    "Sam2CheckpointError",
    "Sam2Config",
    "Sam2Features",
    "Sam2Prediction",
    "load_sam2",
]
