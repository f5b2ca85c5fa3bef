"""Swin Transformer v1 image classifier (ImageNet-1k), written for this service.

Parameter names follow timm so its checkpoints (and Microsoft's, mapped) load as they
are; the forward pass is free of host-device synchronisation and friendly to
`torch.compile` and bf16. `IMAGENET_CLASSES` is read from the shipped
`imagenet_classes.txt` on first use (the first WordNet lemma of each class, in class order).
"""

from __future__ import annotations

from importlib import import_module, resources
from typing import TYPE_CHECKING, Any

from models.swin.config import SWIN_CONFIGS, SwinConfig

if TYPE_CHECKING:
    from models.swin.checkpoint import CheckpointError, load_swin
    from models.swin.model import SwinTransformer, WindowAttention

# Imported on first use (PEP 562), as in models.sam: the configs need no torch.
_LAZY = {
    "CheckpointError": "models.swin.checkpoint",
    "load_swin": "models.swin.checkpoint",
    "SwinTransformer": "models.swin.model",
    "WindowAttention": "models.swin.model",
}

__all__ = [
    "IMAGENET_CLASSES",
    "SWIN_CONFIGS",
    "CheckpointError",
    "SwinConfig",
    "SwinTransformer",
    "WindowAttention",
    "imagenet_classes",
    "load_swin",
]


def imagenet_classes() -> list[str]:
    """The 1000 ImageNet-1k class names in class-index order (0 "tench", 207 "golden retriever")."""
    text = resources.files(__name__).joinpath("imagenet_classes.txt").read_text(encoding="utf-8")
    names = text.splitlines()
    if len(names) != 1000:  # a packaging fault, not a user error
        raise RuntimeError(f"imagenet_classes.txt holds {len(names)} names, expected 1000")
    return names


def __getattr__(name: str) -> Any:
    """Read `IMAGENET_CLASSES` on first access (PEP 562), then keep it as a module global;
    import the torch modules' names on first use."""
    if name == "IMAGENET_CLASSES":
        names = imagenet_classes()
        globals()[name] = names
        return names
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
