"""Meta's side of bench/sam2.py: its `SAM2Base` built by its own `build_sam2` from its
yaml, our weights completed into a Meta release file, its predictor and image path.

Meta's package (`sam2`, with hydra-core and iopath) is imported only inside these
functions: bench/sam2.py's module docstring says how it reaches the GPU machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from models.sam2 import Sam2Config, load_sam2
from models.sam2.checkpoint import to_meta_keys

__all__ = [
    "META_YAML",
    "RELEASED",
    "build_meta",
    "meta_encode",
    "meta_predictor",
    "official_checkpoint",
    "size_overrides",
]

RELEASED = (
    "sam2.1_hiera_tiny",
    "sam2.1_hiera_small",
    "sam2.1_hiera_base_plus",
    "sam2.1_hiera_large",
)
META_YAML = {
    "sam2.1_hiera_tiny": "configs/sam2.1/sam2.1_hiera_t.yaml",
    "sam2.1_hiera_small": "configs/sam2.1/sam2.1_hiera_s.yaml",
    "sam2.1_hiera_base_plus": "configs/sam2.1/sam2.1_hiera_b+.yaml",
    "sam2.1_hiera_large": "configs/sam2.1/sam2.1_hiera_l.yaml",
    "sam2_test_tiny": "configs/sam2.1/sam2.1_hiera_t.yaml",  # sizes overridden
}


def size_overrides(config: Sam2Config) -> list[str]:
    """Hydra overrides giving Meta's yaml our config's trunk and input size: none for a
    released size, whose yaml is ours already (tests/models/test_sam2_checkpoint.py); also
    what the tests build their reference with."""
    if config.name in RELEASED:
        return []

    def seq(values: Sequence[int]) -> str:
        return "[" + ",".join(str(v) for v in values) + "]"

    trunk = "++model.image_encoder.trunk"
    bkg = config.window_pos_embed_bkg_spatial_size
    return [
        f"{trunk}.embed_dim={config.embed_dim}",
        f"{trunk}.num_heads={config.num_heads}",
        f"{trunk}.stages={seq(config.stages)}",
        f"{trunk}.global_att_blocks={seq(config.global_att_blocks)}",
        f"{trunk}.window_spec={seq(config.window_spec)}",
        f"{trunk}.window_pos_embed_bkg_spatial_size={seq(bkg)}",
        f"++model.image_encoder.neck.backbone_channel_list={seq(config.backbone_channel_list)}",
        f"++model.image_size={config.image_size}",
    ]


def build_meta(config: Sam2Config, checkpoint: Path | None, device: str) -> Any:
    """Meta's `SAM2Base` (eval, fp32) from its yaml, loaded by its own `build_sam2`."""
    from sam2.build_sam import build_sam2

    path = None if checkpoint is None else str(checkpoint)
    extra = size_overrides(config)
    return build_sam2(META_YAML[config.name], path, device=device, hydra_overrides_extra=extra)


def official_checkpoint(
    config: Sam2Config, seed: int, folder: Path, source: Path | None = None
) -> Path:
    """The weights as a complete Meta release file: the image path from `source` (a
    `{"model": ...}` file of Meta's keys, e.g. synthetic weights, which hold no video
    modules) or else our seeded random weights, the video modules at Meta's initialisation
    (its `build_sam2` loads strictly)."""
    state = build_meta(config, None, "cpu").state_dict()
    if source is None:
        image_path = to_meta_keys(load_sam2(config, None, seed=seed).state_dict())
    else:
        image_path = torch.load(source, map_location="cpu", weights_only=True)["model"]
    for key, value in image_path.items():
        if key not in state or state[key].shape != value.shape:
            raise SystemExit(f"{key}: not in Meta's model with that shape")
        state[key] = value
    path = folder / f"{config.name}_seed{seed}.pt"
    torch.save({"model": state}, path)
    return path


def meta_predictor(model: Any, config: Sam2Config) -> Any:
    from sam2.sam2_image_predictor import SAM2ImagePredictor

    predictor = SAM2ImagePredictor(model)
    e = config.embedding_size  # Meta hard-codes the 1024-px sizes; the test config's differ
    predictor._bb_feat_sizes = [(4 * e, 4 * e), (2 * e, 2 * e), (e, e)]
    return predictor


def meta_encode(model: Any, images: torch.Tensor) -> list[torch.Tensor]:
    """What `set_image_batch` computes from its normalised batch (features, flattened)."""
    backbone = model.forward_image(images)
    _, feats, _, _ = model._prepare_backbone_features(backbone)
    if model.directly_add_no_mem_embed:
        feats[-1] = feats[-1] + model.no_mem_embed
    return feats
