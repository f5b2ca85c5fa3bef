"""Swin checkpoint loading: random init, round trips in every accepted format and layout,
and a clear CheckpointError naming the file for every kind of bad file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models.sam import CheckpointError as SamCheckpointError
from models.swin import (
    IMAGENET_CLASSES,
    SWIN_CONFIGS,
    CheckpointError,
    SwinConfig,
    SwinTransformer,
    load_swin,
)
from models.swin.checkpoint import to_timm_layout
from tests.models.swin_helpers import timm_to_microsoft

CONFIG = SWIN_CONFIGS["swin_test"]


@pytest.fixture(scope="module")
def good_state() -> dict[str, torch.Tensor]:
    return load_swin(CONFIG, None, seed=3).state_dict()


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory, good_state) -> Path:
    path = tmp_path_factory.mktemp("swin_ckpt") / "good.pth"
    torch.save(good_state, path)
    return path


def test_random_init_is_seeded_and_complete() -> None:
    a, b, c = (load_swin(CONFIG, None, seed=s).state_dict() for s in (0, 0, 1))
    assert len(a) == len(b) == len(c)
    for name, x in a.items():
        assert torch.equal(x, b[name]), name
        assert not torch.equal(x, c[name]), name
        assert bool(torch.isfinite(x).all()), name
        if x.numel() > 1:
            assert float(x.std()) > 0, name  # nothing left at a constant (zeros/ones) init
    table = a["layers.0.blocks.0.attn.relative_position_bias_table"]
    assert float(table.abs().mean()) > 0.1


@pytest.mark.parametrize("checkpoint", ["random", "file"])
def test_loaded_model_is_fp32_cpu_eval(checkpoint: str, good_file: Path) -> None:
    model = load_swin(CONFIG, None if checkpoint == "random" else good_file)
    assert isinstance(model, SwinTransformer)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "cpu", name
        assert t.dtype == (torch.int64 if name.endswith("index") else torch.float32), name
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    # the constant buffers are real (recomputed after the meta-device build), not persistent
    assert not any(k.endswith(("relative_position_index", "attn_mask")) for k in model.state_dict())
    mask = model.layers[0].blocks[1].attn_mask
    assert mask is not None and float(mask.min()) == -100.0 and float(mask.max()) == 0.0


def _save(kind: str, path: Path, state: dict[str, torch.Tensor]) -> Path:
    if kind == "pth":
        torch.save(state, path.with_suffix(".pth"))
    elif kind == "legacy":  # torch.save's pre-1.6 format: no mmap possible
        torch.save(state, path.with_suffix(".pth"), _use_new_zipfile_serialization=False)
    elif kind == "wrapped":  # training scripts' {"state_dict": ...}
        torch.save({"state_dict": state, "epoch": 3}, path.with_suffix(".pth"))
    elif kind == "microsoft":
        torch.save(timm_to_microsoft(state, CONFIG), path.with_suffix(".pth"))
    elif kind == "fp16":
        torch.save({k: v.half() for k, v in state.items()}, path.with_suffix(".pth"))
    else:
        save_file(state, path.with_suffix(".safetensors"))
        return path.with_suffix(".safetensors")
    return path.with_suffix(".pth")


@pytest.mark.parametrize("kind", ["pth", "legacy", "wrapped", "microsoft", "safetensors", "fp16"])
def test_round_trip(kind: str, tmp_path: Path, good_state) -> None:
    path = _save(kind, tmp_path / "weights", good_state)
    loaded = load_swin(CONFIG, str(path)).state_dict()  # str paths are accepted too
    assert loaded.keys() == good_state.keys()
    for k, v in good_state.items():
        expected = v.half().float() if kind == "fp16" else v
        assert loaded[k].dtype == torch.float32, k
        assert torch.equal(loaded[k], expected), k


def test_microsoft_mapping() -> None:
    """Downsample moves one stage later, `head` becomes `head.fc`, saved buffers are dropped."""
    state = {
        "layers.0.downsample.reduction.weight": torch.zeros(1),
        "layers.0.blocks.1.attn_mask": torch.zeros(1),
        "layers.0.blocks.1.attn.relative_position_index": torch.zeros(1),
        "layers.1.blocks.0.attn.qkv.weight": torch.zeros(1),
        "head.weight": torch.zeros(1),
        "head.bias": torch.zeros(1),
    }
    assert sorted(to_timm_layout(state)) == [
        "head.fc.bias",
        "head.fc.weight",
        "layers.1.blocks.0.attn.qkv.weight",
        "layers.1.downsample.reduction.weight",
    ]
    timm_keys = {"layers.1.downsample.reduction.weight": torch.zeros(1)}
    assert list(to_timm_layout(timm_keys)) == list(timm_keys)


def _truncated(path: Path, good: Path) -> str:
    data = good.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return "truncated"


def _truncated_safetensors(path: Path, good: Path) -> str:
    state = torch.load(good, weights_only=True)
    full = path.with_suffix(".full")
    save_file(state, full)
    data = full.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return "safetensors"


def _text(path: Path, good: Path) -> str:
    path.write_text("this is not a checkpoint\n")
    return "not a readable"


def _not_a_dict(path: Path, good: Path) -> str:
    torch.save([torch.zeros(3)], path)
    return "expected a state dict"


def _empty_dict(path: Path, good: Path) -> str:
    torch.save({}, path)
    return "empty"


def _not_tensors(path: Path, good: Path) -> str:
    torch.save({"patch_embed.proj.weight": 1.0}, path)
    return "not tensors"


def _missing_key(path: Path, good: Path) -> str:
    state = torch.load(good, weights_only=True)
    del state["head.fc.weight"]
    torch.save(state, path)
    return "missing keys, e.g. ['head.fc.weight']"


def _unexpected_key(path: Path, good: Path) -> str:
    state = torch.load(good, weights_only=True)
    state["layers.0.blocks.0.attn.extra"] = torch.zeros(3)
    torch.save(state, path)
    return "unexpected keys, e.g. ['layers.0.blocks.0.attn.extra']"


def _wrong_model_size(path: Path, good: Path) -> str:
    wider = dataclasses.replace(CONFIG, name="wider", embed_dim=48)
    torch.save(load_swin(wider, None).state_dict(), path)
    return "patch_embed.proj.weight: expected (32, 3, 4, 4), got (48, 3, 4, 4)"


def _wrong_depth(path: Path, good: Path) -> str:
    deeper = dataclasses.replace(CONFIG, name="deeper", depths=(2, 4))
    torch.save(load_swin(deeper, None).state_dict(), path)
    return "unexpected keys, e.g. ['layers.1.blocks.2."


def _integer_tensor(path: Path, good: Path) -> str:
    state = torch.load(good, weights_only=True)
    state["norm.bias"] = state["norm.bias"].long()
    torch.save(state, path)
    return "non-floating-point tensors, e.g. ['norm.bias']"


def _pickled_object(path: Path, good: Path) -> str:
    torch.save({"model": torch.load(good, weights_only=True), "config": object()}, path)
    return "not a readable PyTorch checkpoint"


BAD_FILES: dict[str, Callable[[Path, Path], str]] = {
    "truncated.pth": _truncated,
    "truncated.safetensors": _truncated_safetensors,
    "text.pth": _text,
    "text.safetensors": _text,
    "list.pth": _not_a_dict,
    "empty.pth": _empty_dict,
    "floats.pth": _not_tensors,
    "missing.pth": _missing_key,
    "unexpected.pth": _unexpected_key,
    "wider.pth": _wrong_model_size,
    "deeper.pth": _wrong_depth,
    "integer.pth": _integer_tensor,
    "pickled.pth": _pickled_object,
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_raises_naming_file_and_problem(name: str, tmp_path: Path, good_file) -> None:
    path = tmp_path / name
    problem = BAD_FILES[name](path, good_file)
    with pytest.raises(CheckpointError) as info:
        load_swin(CONFIG, path)
    message = str(info.value)
    assert str(path) in message
    assert problem in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.pth"
    with pytest.raises(CheckpointError, match="file not found") as info:
        load_swin(CONFIG, path)
    assert str(path) in str(info.value)


def test_one_error_class_for_both_models() -> None:
    assert CheckpointError is SamCheckpointError
    assert issubclass(CheckpointError, ValueError)


def test_config_registry() -> None:
    assert set(SWIN_CONFIGS) == {
        "swin_tiny_patch4_window7_224",
        "swin_small_patch4_window7_224",
        "swin_base_patch4_window7_224",
        "swin_test",
    }
    tiny = SwinConfig.from_name("swin_tiny_patch4_window7_224")
    assert (tiny.embed_dim, tiny.depths, tiny.num_heads) == (96, (2, 2, 6, 2), (3, 6, 12, 24))
    assert (tiny.input_size, tiny.crop_pct, tiny.resize_size) == ((3, 224, 224), 0.9, 248)
    with pytest.raises(ValueError, match="swin_base_patch4_window7_224, swin_small"):
        SwinConfig.from_name("swin_huge")
    with pytest.raises(ValueError, match="not a multiple"):
        SwinConfig("bad", 32, (2,), (2,), img_size=40, window_size=4)  # 10x10 grid


def test_parameter_count_matches_timm() -> None:
    """timm reports 28,288,354 parameters for swin_tiny_patch4_window7_224."""
    with torch.device("meta"):
        model = SwinTransformer(SWIN_CONFIGS["swin_tiny_patch4_window7_224"])
    assert sum(p.numel() for p in model.parameters()) == 28_288_354


def test_imagenet_classes() -> None:
    assert len(IMAGENET_CLASSES) == 1000
    assert IMAGENET_CLASSES[0] == "tench"
    assert IMAGENET_CLASSES[207] == "golden retriever"
    assert IMAGENET_CLASSES[999] == "toilet tissue"
    assert len(set(IMAGENET_CLASSES)) >= 998  # "crane" and "maillot" name two classes each
    assert all(name and name == name.strip() for name in IMAGENET_CLASSES)
