"""Parity with HF transformers' Swin on the same random weights, written in timm's layout
(`.pth` and `.safetensors`) and in Microsoft's original one; bf16 and compile sanity."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from models.swin import SWIN_CONFIGS, SwinConfig, SwinTransformer, WindowAttention, load_swin
from tests.models.swin_helpers import (
    build_hf_swin,
    hf_to_timm,
    relative_error,
    timm_to_microsoft,
)

# Four stages at the released geometry (56, 28, 14, 7 grids, window 7: shifted windows in
# stages 0-2, none in stage 3 where one window covers the grid), but narrow, so it is cheap.
NARROW = SwinConfig("swin_narrow_224", 16, (2, 2, 2, 2), (1, 2, 2, 4))
CONFIGS = {
    "swin_test": SWIN_CONFIGS["swin_test"],
    "swin_narrow_224": NARROW,
    "swin_tiny_patch4_window7_224": SWIN_CONFIGS["swin_tiny_patch4_window7_224"],
}
LAYOUTS = ["pth", "safetensors", "microsoft"]
# every layout on the cheap configs; the real Swin-T (28M parameters) in timm's hub format
CASES = [(c, layout) for c in ("swin_test", "swin_narrow_224") for layout in LAYOUTS]
CASES.append(("swin_tiny_patch4_window7_224", "safetensors"))


Reference = tuple[Any, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def reference() -> Callable[[str], Reference]:
    """name -> (HF model with random weights, the same weights in timm's keys), built once."""
    built: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in built:
            hf = build_hf_swin(CONFIGS[name], seed=1234)
            built[name] = (hf, hf_to_timm(hf.state_dict()))
        return built[name]

    return get


def _write(layout: str, folder: Path, state: dict[str, torch.Tensor], config: SwinConfig) -> Path:
    if layout == "safetensors":
        path = folder / "timm.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    elif layout == "microsoft":
        path = folder / "microsoft.pth"
        torch.save(timm_to_microsoft(state, config), path)
    else:
        path = folder / "timm.pth"
        torch.save(state, path)
    return path


def _inputs(config: SwinConfig, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, config.img_size, config.img_size, generator=g)


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_logits_match_hf(
    reference: Callable[[str], Reference], name: str, layout: str, tmp_path: Path
) -> None:
    config = CONFIGS[name]
    hf, timm_state = reference(name)
    model = load_swin(config, _write(layout, tmp_path, timm_state, config))
    x = _inputs(config, 3, seed=7)
    with torch.inference_mode():
        expected = hf(pixel_values=x).logits
        actual = model(x)
    assert actual.shape == (3, config.num_classes)
    assert relative_error(actual, expected) < 1e-4
    # a meaningful comparison: the logits differ between images and are not tiny
    assert float(expected.std()) > 0.1
    assert float((expected[0] - expected[1]).abs().max()) > 0.1


@pytest.mark.parametrize("name", ["swin_test", "swin_narrow_224"])
def test_position_bias_matters(
    reference: Callable[[str], Reference], name: str, tmp_path: Path
) -> None:
    """Zeroing the bias tables changes the logits: parity above really covers them."""
    config = CONFIGS[name]
    model = load_swin(config, _write("pth", tmp_path, reference(name)[1], config))
    x = _inputs(config, 2, seed=8)
    with torch.inference_mode():
        before = model(x)
        for key, p in model.named_parameters():
            if key.endswith("relative_position_bias_table"):
                p.zero_()
        after = model(x)
    assert relative_error(after, before) > 1e-2


@pytest.fixture
def test_model() -> SwinTransformer:
    return load_swin(SWIN_CONFIGS["swin_test"], None, seed=5)


def test_bf16_top1_agrees_with_fp32(test_model: SwinTransformer) -> None:
    config = test_model.config
    x = _inputs(config, 32, seed=9)
    with torch.inference_mode():
        fp32 = test_model(x)
        bf16 = test_model.to(torch.bfloat16)(x)
    assert bf16.dtype == torch.bfloat16
    assert bool(torch.isfinite(bf16).all())
    assert relative_error(bf16.float(), fp32) < 0.05
    agree = (bf16.float().argmax(-1) == fp32.argmax(-1)).float().mean()
    assert float(agree) >= 0.75


def test_written_out_attention_matches_sdpa() -> None:
    """The default written-out attention computes SDPA's logits, shifted-window masks
    included (NARROW shifts in three of its four stages), so either form serves the
    checkpoints the parity tests above check."""
    model = load_swin(NARROW, None, seed=6)
    x = _inputs(NARROW, 2, seed=12)
    layers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    # "auto", the default, is the written-out form on the CPU (the kernel is CUDA's)
    assert layers and all(layer.chosen_form(x.device) == "matmul" for layer in layers)
    with torch.inference_mode():
        written_out = model(x)
        for layer in layers:
            layer.form = "sdpa"
        sdpa = model(x)
    torch.testing.assert_close(written_out, sdpa, rtol=1e-4, atol=1e-4)
    assert relative_error(written_out, sdpa) < 1e-5


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph(test_model: SwinTransformer, fresh_dynamo: None) -> None:
    """Graph capture without breaks (no host syncs, no data-dependent branches); the
    "eager" backend checks capture alone in about a second."""
    compiled = torch.compile(test_model, fullgraph=True, backend="eager")
    x = _inputs(test_model.config, 2, seed=10)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), test_model(x), rtol=1e-5, atol=1e-5)


def test_random_weights_are_seeded() -> None:
    config = SWIN_CONFIGS["swin_test"]
    a, b, c = (load_swin(config, None, seed=s) for s in (0, 0, 1))
    x = _inputs(config, 2, seed=11)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))
        assert not torch.equal(a(x), c(x))
