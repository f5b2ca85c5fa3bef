"""Meta's reference SAM 2.1 (`sam2` package) at the sizes of one of our configs.

Built through Meta's own `build_sam2` from its shipped yaml, so every flag of the image
path (high-res features, sigmoid IoU, object scores, dynamic multimask) is Meta's; the
tiny test config only overrides the trunk's sizes and the input size. Meta's package
imports torchvision; tests/conftest.py provides the test-only stand-in where needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bench.sam2_meta import META_YAML, size_overrides
from models.sam2 import Sam2Config


def build_reference_sam2(config: Sam2Config, *, override_sizes: bool, device: str = "cpu") -> Any:
    """Meta's `SAM2Base` in eval mode; `override_sizes=False` takes the yaml as shipped."""
    from sam2.build_sam import build_sam2

    extra = size_overrides(config) if override_sizes else []
    return build_sam2(META_YAML[config.name], None, device=device, hydra_overrides_extra=extra)


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Seeded non-trivial values for every tensor (Meta zero-initialises several: position
    tables, no_mem_embed, biases), scaled by fan-in so activations stay O(1) in depth."""
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def normal_(t: Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)
        done.add(id(t))

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d | nn.ConvTranspose2d):
            w = module.weight
            fan_in = w.shape[0] if isinstance(module, nn.ConvTranspose2d) else w[0].numel()
            normal_(w, fan_in**-0.5)
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, 1.0)
        elif type(module).__name__ in ("LayerNorm", "LayerNorm2d"):
            normal_(module.weight, 0.1, mean=1.0)
            normal_(module.bias, 0.02)
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done and t.is_floating_point():
            # the random-Fourier matrix keeps Meta's unit scale; position tables get 0.1
            normal_(t, 1.0 if name.endswith("positional_encoding_gaussian_matrix") else 0.1)


def save_official(model: nn.Module, path: Path) -> Path:
    """The state dict in Meta's release format, `{"model": state_dict}`."""
    torch.save({"model": model.state_dict()}, path)
    return path
