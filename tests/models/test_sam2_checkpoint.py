"""Loading Meta's SAM 2.1 checkpoint format: every released size maps key for key, video
keys are skipped with a count, and a wrong file stops with an error naming the problem.

The released sizes are checked against Meta's own model built from its shipped yaml
(random init, no download): same keys after the documented MLP renaming, same shapes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from models.sam2 import SAM2_CONFIGS, Sam2, Sam2CheckpointError, Sam2Config, load_sam2
from models.sam2.checkpoint import map_checkpoint_keys
from tests.models.sam2_reference import build_reference_sam2, randomize, save_official

VIDEO_PREFIXES = (
    "memory_attention.",
    "memory_encoder.",
    "obj_ptr_proj.",
    "obj_ptr_tpos_proj.",
    "mask_downsample.",
    "maskmem_tpos_enc",
    "no_mem_pos_enc",
    "no_obj_ptr",
    "no_obj_embed_spatial",
)


RELEASED = [
    "sam2.1_hiera_tiny",
    "sam2.1_hiera_small",
    "sam2.1_hiera_base_plus",
    "sam2.1_hiera_large",
]


@pytest.mark.parametrize("name", RELEASED)
def test_released_config_matches_meta_yaml(name: str) -> None:
    config = SAM2_CONFIGS[name]
    reference = build_reference_sam2(config, override_sizes=False)
    mapped, skipped = map_checkpoint_keys(reference.state_dict())
    with torch.device("meta"):
        ours = Sam2(config)
    theirs = {k: tuple(v.shape) for k, v in mapped.items()}
    assert theirs == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert trunk_widths(reference) == config.backbone_channel_list
    assert skipped and all(k.startswith(VIDEO_PREFIXES) for k in skipped)


def trunk_widths(reference: Any) -> tuple[int, ...]:
    return tuple(reference.image_encoder.trunk.channel_list)


@pytest.fixture(scope="module")
def config() -> Sam2Config:
    return SAM2_CONFIGS["sam2_test_tiny"]


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory, config: Sam2Config) -> dict[str, Any]:
    """Meta's tiny model's state dict in the release format, as a dict (to corrupt copies)."""
    reference = build_reference_sam2(config, override_sizes=True)
    randomize(reference, seed=11)
    path = save_official(reference, tmp_path_factory.mktemp("sam2") / "tiny.pt")
    return torch.load(path, weights_only=True)


def _save(tmp_path: Path, blob: object) -> Path:
    path = tmp_path / "checkpoint.pt"
    torch.save(blob, path)
    return path


def test_loads_and_skips_video_keys_with_a_count(
    tmp_path: Path, official: dict[str, Any], config: Sam2Config, caplog: pytest.LogCaptureFixture
) -> None:
    state = official["model"]
    video = [k for k in state if k.startswith(VIDEO_PREFIXES)]
    assert len(video) > 100  # the memory modules are really in the file
    with caplog.at_level(logging.INFO, logger="models.sam2.checkpoint"):
        model = load_sam2(config, _save(tmp_path, official))
    assert f"{len(video)} video-only tensors skipped" in caplog.text
    assert not model.training
    ours = model.state_dict()
    assert torch.equal(ours["no_mem_embed"], state["no_mem_embed"])
    # the renamed MLP of the two-way transformer carries Meta's tensors
    assert torch.equal(
        ours["sam_mask_decoder.transformer.layers.1.mlp.lin2.weight"],
        state["sam_mask_decoder.transformer.layers.1.mlp.layers.1.weight"],
    )


def test_missing_image_key_is_named(
    tmp_path: Path, official: dict[str, Any], config: Sam2Config
) -> None:
    state = dict(official["model"])
    del state["sam_mask_decoder.conv_s0.weight"]
    with pytest.raises(Sam2CheckpointError, match=r"missing image-path keys.*conv_s0\.weight"):
        load_sam2(config, _save(tmp_path, {"model": state}))


def test_wrong_shape_is_named(tmp_path: Path, official: dict[str, Any], config: Sam2Config) -> None:
    state = dict(official["model"])
    state["image_encoder.trunk.pos_embed"] = torch.zeros(1, 16, 14, 14)
    with pytest.raises(Sam2CheckpointError, match=r"image_encoder\.trunk\.pos_embed: expected"):
        load_sam2(config, _save(tmp_path, {"model": state}))


def test_other_size_is_refused(tmp_path: Path, official: dict[str, Any]) -> None:
    with pytest.raises(Sam2CheckpointError, match=r"is this checkpoint for sam2\.1_hiera_tiny"):
        load_sam2(SAM2_CONFIGS["sam2.1_hiera_tiny"], _save(tmp_path, official))


def test_bare_state_dict_is_refused(
    tmp_path: Path, official: dict[str, Any], config: Sam2Config
) -> None:
    with pytest.raises(Sam2CheckpointError, match=r"expected Meta's format \{'model'"):
        load_sam2(config, _save(tmp_path, official["model"]))


def test_unreadable_files_are_refused(tmp_path: Path, config: Sam2Config) -> None:
    with pytest.raises(Sam2CheckpointError, match="file not found"):
        load_sam2(config, tmp_path / "absent.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(Sam2CheckpointError, match="not a readable PyTorch checkpoint"):
        load_sam2(config, junk)


def test_seeded_random_weights(config: Sam2Config) -> None:
    """No checkpoint: the same seed gives the same weights, every tensor is set (none left
    as `to_empty` memory or all zeros), and a click gives a non-degenerate answer."""
    a, b, c = (load_sam2(config, None, seed=s) for s in (3, 3, 4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(torch.isfinite(t).all() and t.std() > 0 for t in sa.values() if t.numel() > 1)
    images = torch.randn(1, 3, config.image_size, config.image_size)
    click, positive = torch.tensor([[[100.0, 90.0]]]), torch.tensor([[1]])
    with torch.no_grad():
        prediction = a.decode(a.encode(images), click, positive)
    foreground = (prediction.low_res_masks > 0).float().mean().item()
    assert 0.01 < foreground < 0.99
    assert ((prediction.iou > 0) & (prediction.iou < 1)).all()
