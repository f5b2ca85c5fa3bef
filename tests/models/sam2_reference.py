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

from models.sam2 import Sam2Config

# our config name -> Meta's yaml (the tiny test config borrows hiera_t's)
META_YAML = {
    "sam2.1_hiera_tiny": "configs/sam2.1/sam2.1_hiera_t.yaml",
    "sam2.1_hiera_small": "configs/sam2.1/sam2.1_hiera_s.yaml",
    "sam2.1_hiera_base_plus": "configs/sam2.1/sam2.1_hiera_b+.yaml",
    "sam2.1_hiera_large": "configs/sam2.1/sam2.1_hiera_l.yaml",
    "sam2_test_tiny": "configs/sam2.1/sam2.1_hiera_t.yaml",
}


def _sizes_override(config: Sam2Config) -> list[str]:
    """Hydra overrides giving Meta's trunk, neck and input size the values of `config`."""

    def seq(values: tuple[int, ...]) -> str:
        return "[" + ",".join(str(v) for v in values) + "]"

    trunk = "++model.image_encoder.trunk"
    return [
        f"{trunk}.embed_dim={config.embed_dim}",
        f"{trunk}.num_heads={config.num_heads}",
        f"{trunk}.stages={seq(config.stages)}",
        f"{trunk}.global_att_blocks={seq(config.global_att_blocks)}",
        f"{trunk}.window_spec={seq(config.window_spec)}",
        f"{trunk}.window_pos_embed_bkg_spatial_size="
        f"{seq(config.window_pos_embed_bkg_spatial_size)}",
        f"++model.image_encoder.neck.backbone_channel_list={seq(config.backbone_channel_list)}",
        f"++model.image_size={config.image_size}",
    ]


def build_reference_sam2(config: Sam2Config, *, override_sizes: bool, device: str = "cpu") -> Any:
    """Meta's `SAM2Base` in eval mode; `override_sizes=False` takes the yaml as shipped."""
    from sam2.build_sam import build_sam2

    extra = _sizes_override(config) if override_sizes else []
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
