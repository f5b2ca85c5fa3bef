"""The SAM config registry: Meta's sizes, derived sizes, and the contract of every model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.sam import SAM_CONFIGS, PromptSet, Sam, SamConfig, load_sam, pack_prompts

META_SIZES = {
    "vit_b": (768, 12, 12, (2, 5, 8, 11)),
    "vit_l": (1024, 24, 16, (5, 11, 17, 23)),
    "vit_h": (1280, 32, 16, (7, 15, 23, 31)),
}


@pytest.mark.parametrize("name", sorted(META_SIZES))
def test_released_sizes(name: str) -> None:
    config = SAM_CONFIGS[name]
    dims = (
        config.encoder_embed_dim,
        config.encoder_depth,
        config.encoder_num_heads,
        config.encoder_global_attn_indexes,
    )
    assert dims == META_SIZES[name]
    assert (config.image_size, config.patch_size, config.window_size) == (1024, 16, 14)
    assert (config.prompt_embed_dim, config.mask_in_chans) == (256, 16)
    assert (config.embedding_size, config.mask_input_size) == (64, 256)


@pytest.mark.parametrize("name", sorted(SAM_CONFIGS))
def test_preprocessing_constants(name: str) -> None:
    config = SamConfig.from_name(name)
    assert config.name == name
    assert config.pixel_mean == (123.675, 116.28, 103.53)
    assert config.pixel_std == (58.395, 57.12, 57.375)
    assert config.mask_threshold == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.image_size = 512  # type: ignore[misc]


def test_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="vit_b, vit_h, vit_l, vit_tiny"):
        SamConfig.from_name("vit_x")


def test_inconsistent_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="divide"):
        dataclasses.replace(SAM_CONFIGS["vit_tiny"], encoder_num_heads=3)
    with pytest.raises(ValueError, match="out of range"):
        dataclasses.replace(SAM_CONFIGS["vit_tiny"], encoder_global_attn_indexes=(5,))


@pytest.mark.parametrize("name", sorted(SAM_CONFIGS))
def test_shapes_contract(name: str) -> None:
    """Build on the meta device (no memory, no compute) and trace the shapes of both passes."""
    config = SAM_CONFIGS[name]
    with torch.device("meta"):
        model = Sam(config)
        images = torch.empty(2, 3, config.image_size, config.image_size)
        embeddings = model.encode(images)
    side = config.embedding_size
    assert embeddings.shape == (2, 256, side, side)
    prompts = pack_prompts([PromptSet([[1, 2]], [1]), PromptSet(box=[0, 0, 5, 5])], [0, 1], "meta")
    low_res, iou = model.decode(embeddings, prompts)
    assert low_res.shape == (2, 4, 4 * side, 4 * side)
    assert iou.shape == (2, 4)


def test_encode_rejects_wrong_size(tiny_config: SamConfig) -> None:
    model = load_sam(tiny_config, None)
    with pytest.raises(ValueError, match="256"):
        model.encode(torch.zeros(1, 3, 128, 128))
