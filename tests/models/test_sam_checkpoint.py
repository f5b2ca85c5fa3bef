"""Checkpoint loading: random init, round trips, and a clear CheckpointError for bad files."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from models.sam import CheckpointError, SamConfig, load_sam


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory, tiny_config: SamConfig) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "good.pth"
    torch.save(load_sam(tiny_config, None, seed=3).state_dict(), path)
    return path


def test_random_init_is_seeded_and_complete(tiny_config: SamConfig) -> None:
    a = load_sam(tiny_config, None, seed=0)
    b = load_sam(tiny_config, None, seed=0)
    c = load_sam(tiny_config, None, seed=1)
    for (name, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
        assert not torch.equal(x, z), name
        assert bool(torch.isfinite(x).all()), name
        if x.is_floating_point() and x.numel() > 1:
            assert float(x.std()) > 0, name  # nothing left at a constant (zeros/ones) init
    assert float(a.state_dict()["image_encoder.blocks.0.attn.rel_pos_h"].abs().mean()) > 0.01


@pytest.mark.parametrize("checkpoint", ["random", "file"])
def test_loaded_model_is_fp32_cpu_eval(checkpoint: str, good_file: Path, tiny_config) -> None:
    model = load_sam(tiny_config, None if checkpoint == "random" else good_file)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.pixel_std.flatten().tolist() == pytest.approx(list(tiny_config.pixel_std))


def test_round_trip(good_file: Path, tiny_config: SamConfig) -> None:
    expected = load_sam(tiny_config, None, seed=3).state_dict()
    loaded = load_sam(tiny_config, good_file).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_legacy_non_zip_format_loads(tmp_path: Path, good_file: Path, tiny_config) -> None:
    path = tmp_path / "legacy.pth"
    state = torch.load(good_file, weights_only=True)
    torch.save(state, path, _use_new_zipfile_serialization=False)
    loaded = load_sam(tiny_config, path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def _truncated(path: Path, good: Path, config: SamConfig) -> None:
    data = good.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _text(path: Path, good: Path, config: SamConfig) -> None:
    path.write_text("this is not a checkpoint\n")


def _not_a_dict(path: Path, good: Path, config: SamConfig) -> None:
    torch.save([torch.zeros(3)], path)


def _not_tensors(path: Path, good: Path, config: SamConfig) -> None:
    torch.save({"image_encoder.pos_embed": 1.0}, path)


def _missing_key(path: Path, good: Path, config: SamConfig) -> None:
    state = torch.load(good, weights_only=True)
    del state["mask_decoder.iou_token.weight"]
    torch.save(state, path)


def _extra_key(path: Path, good: Path, config: SamConfig) -> None:
    state = torch.load(good, weights_only=True)
    state["image_encoder.extra.weight"] = torch.zeros(2)
    torch.save(state, path)


def _wrong_size(path: Path, good: Path, config: SamConfig) -> None:
    """A wider and deeper encoder, as a vit_l checkpoint is to vit_b."""
    bigger = dataclasses.replace(
        config,
        name="bigger",
        encoder_embed_dim=96,
        encoder_depth=3,
        encoder_num_heads=3,
        encoder_global_attn_indexes=(2,),
    )
    torch.save(load_sam(bigger, None).state_dict(), path)


BAD_FILES: list[tuple[str, Callable[[Path, Path, SamConfig], None], list[str]]] = [
    ("truncated", _truncated, ["not a readable PyTorch checkpoint"]),
    ("text", _text, ["not a readable PyTorch checkpoint"]),
    ("not_a_dict", _not_a_dict, ["expected a state dict", "list"]),
    ("not_tensors", _not_tensors, ["not a state dict of tensors", "image_encoder.pos_embed"]),
    ("missing_key", _missing_key, ["1 missing keys", "mask_decoder.iou_token.weight"]),
    ("extra_key", _extra_key, ["1 unexpected keys", "image_encoder.extra.weight"]),
    (
        "wrong_size",
        _wrong_size,
        ["shape mismatch", "image_encoder.pos_embed", "model name may be wrong", "vit_tiny"],
    ),
]


@pytest.mark.parametrize(
    ("make", "fragments"), [(m, f) for _, m, f in BAD_FILES], ids=[n for n, _, _ in BAD_FILES]
)
def test_bad_checkpoint_raises_checkpoint_error(
    make, fragments: list[str], tmp_path: Path, good_file: Path, tiny_config: SamConfig
) -> None:
    path = tmp_path / "bad.pth"
    make(path, good_file, tiny_config)
    with pytest.raises(CheckpointError) as info:
        load_sam(tiny_config, path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file(tmp_path: Path, tiny_config: SamConfig) -> None:
    path = tmp_path / "absent.pth"
    with pytest.raises(CheckpointError, match="file not found") as info:
        load_sam(tiny_config, path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
