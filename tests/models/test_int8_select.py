"""The int8 layers' two kernels, GELU fused into the MLPs, and the per-layer choice."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import int8_select
from models.int8_gptq import gptq_int8
from models.int8_select import (
    calibration_run,
    choose_float_layers,
    int8_include,
    int8_layer_errors,
    leaves_images,
    smooth_images,
)
from models.optimize import OptimizeOptions, prepare_swin
from models.quantize import Int8DynamicLinear, linear_reference, quantize_linears
from models.swin import SwinConfig, SwinTransformer
from models.swin.model import Mlp

TINY = SwinConfig(
    name="swin_test", embed_dim=32, depths=(2, 2), num_heads=(2, 4), img_size=64,
    window_size=4, num_classes=10,
)  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def tiny_swin() -> SwinTransformer:
    torch.manual_seed(0)
    return SwinTransformer(TINY).eval()


def test_fused_and_int_mm_kernels_agree() -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 288)
    x = torch.randn(4, 50, 96, generator=g)
    fused = Int8DynamicLinear(linear)
    old = Int8DynamicLinear(linear, kernel="int_mm")
    assert fused.kernel == "fused" and old.kernel == "int_mm"
    assert torch.equal(fused(x), old(x))  # the same arithmetic, bit for bit
    fused.gelu = old.gelu = True
    torch.testing.assert_close(fused(x), old(x), rtol=1e-6, atol=1e-6)
    assert rel(fused(x), linear_reference(fused, x)) < 0.02


def test_gelu_moves_into_the_first_mlp_product() -> None:
    model = tiny_swin()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    unfused = copy.deepcopy(model)
    include = lambda name, layer: ".blocks." in name  # noqa: E731
    quantize_linears(model, "int8", include)
    mlps = [m for m in model.modules() if isinstance(m, Mlp)]
    assert len(mlps) == 4
    for mlp in mlps:
        assert isinstance(mlp.act, nn.Identity)
        assert isinstance(mlp.fc1, Int8DynamicLinear) and mlp.fc1.gelu
        assert isinstance(mlp.fc2, Int8DynamicLinear) and not mlp.fc2.gelu
    # the same as quantizing without moving GELU (the int_mm layers, GELU left as it was)
    quantize_linears(unfused, "int8", lambda n, layer: include(n, layer) and ".fc1" not in n)
    for mlp in (m for m in unfused.modules() if isinstance(m, Mlp)):
        mlp.fc1 = Int8DynamicLinear(mlp.fc1, kernel="int_mm")
        assert isinstance(mlp.act, nn.GELU)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), unfused(x), rtol=1e-4, atol=1e-4)
    # a first layer left in float keeps its GELU module
    kept = tiny_swin()
    quantize_linears(kept, "int8", lambda n, layer: include(n, layer) and ".fc1" not in n)
    assert all(isinstance(m.act, nn.GELU) for m in kept.modules() if isinstance(m, Mlp))


class Outlier(nn.Module):
    """Scales one input channel by 100: per-token int8 of what follows loses its precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., :1] * 100, x[..., 1:]], dim=-1)


def test_the_layer_with_outlier_inputs_is_measured_worst_and_kept_in_float() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), Outlier(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    errors = int8_layer_errors(model, lambda: model(x), lambda n, layer: True)
    assert set(errors) == {"0", "1", "3"}
    assert errors["3"] > 2 * max(errors["0"], errors["1"]) and errors["0"] > 0
    assert choose_float_layers(errors, max_error=errors["1"] * 2, max_kept=0.5) == ("3",)
    # at most max_kept of the layers, worst first
    assert choose_float_layers(errors, max_error=0.0, max_kept=0.4) == ("3",)
    assert choose_float_layers(errors, max_error=1.0) == ()
    include, choice = int8_include(model, lambda: model(x), lambda n, layer: True,
                                   max_error=errors["1"] * 2, max_kept=0.5)  # fmt: skip
    assert choice.kept_float == ("3",) and choice.quantized == ("0", "1")
    assert quantize_linears(model, "int8", include) == ["0", "1"]
    assert isinstance(model[3], nn.Linear)


def test_swin_int8_by_backend() -> None:
    """core: the fused layers and the per-layer choice (on `smooth_images`); int_mm: every
    candidate layer through torch._int_mm; both close to the float model."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    base = tiny_swin()
    with torch.inference_mode():
        want = base(x)
    outputs = {}
    for backend in ("core", "int_mm"):
        model = copy.deepcopy(base)
        options = OptimizeOptions(quantization="int8", quantization_backend=backend)
        prepare_swin(model, options)
        layers = [m for m in model.modules() if isinstance(m, Int8DynamicLinear)]
        assert {m.kernel for m in layers} == {"fused" if backend == "core" else "int_mm"}
        floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if backend == "int_mm":
            # the head and the patch merging's reduction (not in a block) stay float
            assert len(layers) == 16 and set(floats) == {"head.fc", "layers.1.downsample.reduction"}
        else:
            assert 14 <= len(layers) <= 16  # at most 1/8 of the 16 kept in float
        with torch.inference_mode():
            outputs[backend] = model(x)
        assert 0 < rel(outputs[backend], want) < 0.05
    assert OptimizeOptions(quantization="int8", quantization_backend="int_mm").variant == (
        "fp32+int8+int_mm"
    )


def test_calibration_images_are_normalised_and_seeded() -> None:
    a, b = smooth_images(3, 64, seed=5), smooth_images(3, 64, seed=5)
    assert a.shape == (3, 3, 64, 64) and torch.equal(a, b)
    torch.testing.assert_close(a.mean(dim=(2, 3)), torch.zeros(3, 3), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.std(dim=(2, 3)), torch.ones(3, 3), atol=1e-5, rtol=0)
    # smooth: neighbouring pixels are close (white noise would differ by ~1.4 std)
    assert float((a[..., 1:] - a[..., :-1]).abs().mean()) < 0.5
    model = tiny_swin().to(torch.bfloat16)
    out = calibration_run(64, 2)(model)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10) and out.dtype == torch.bfloat16
    # in chunks (SAM at 1024 px): the same images, a few a call
    chunks = calibration_run(64, 3, chunk=2)(model)
    assert isinstance(chunks, list) and [c.shape[0] for c in chunks] == [2, 1]
    torch.testing.assert_close(torch.cat(chunks), calibration_run(64, 3)(model))


def test_leaves_images_are_seeded_photo_like_pixels_with_edges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flat discs over each other in normalised pixel range: most neighbours equal, a few
    steps as large as a photo's edges; `padded`: zeros past a photo's extent, as SAM's
    pre-processing pads; `calibration_run` makes them for padded inputs (SAM) or when
    `SYNTHETIC` says so."""
    a, b = leaves_images(3, 128, seed=5), leaves_images(3, 128, seed=5)
    assert a.shape == (3, 3, 128, 128) and torch.equal(a, b)
    assert not torch.equal(a, leaves_images(3, 128, seed=6))
    lowest = (0 - 0.485) / 0.229  # black and white through ImageNet's normalisation
    assert float(a.min()) >= lowest - 1e-4 and float(a.max()) <= (1 - 0.406) / 0.225 + 1e-4
    steps = (a[..., 1:] - a[..., :-1]).abs()
    assert float(steps.median()) < 0.1  # mostly flat regions (the texture only)
    assert float(steps.max()) > 2.0  # and edges between discs
    padded = leaves_images(8, 128, seed=5, padded=True)
    empty_rows = (padded == 0).all(dim=(1, 3))  # [n, rows]: a row all padding
    empty_cols = (padded == 0).all(dim=(1, 2))
    for k in range(8):  # the padding is one side's tail, 0-45% of it
        rows, cols = int(empty_rows[k].sum()), int(empty_cols[k].sum())
        assert (rows == 0) != (cols == 0) or rows == cols == 0
        assert max(rows, cols) <= 0.45 * 128 + 1
        if rows:
            assert bool(empty_rows[k, -rows:].all())
        if cols:
            assert bool(empty_cols[k, -cols:].all())
    assert int(empty_rows.sum() + empty_cols.sum()) > 0
    model = tiny_swin()
    # by default each model its measured kind: leaves for padded inputs (SAM), smooth else
    assert int8_select.SYNTHETIC is None
    torch.testing.assert_close(
        calibration_run(64, 2, padded=True)(model), model(leaves_images(2, 64, padded=True))
    )
    torch.testing.assert_close(calibration_run(64, 2)(model), model(smooth_images(2, 64)))
    monkeypatch.setattr(int8_select, "SYNTHETIC", "leaves")
    torch.testing.assert_close(calibration_run(64, 2)(model), model(leaves_images(2, 64)))
    monkeypatch.setattr(int8_select, "SYNTHETIC", "smooth")
    torch.testing.assert_close(
        calibration_run(64, 2, padded=True)(model), model(smooth_images(2, 64))
    )
    monkeypatch.setattr(int8_select, "SYNTHETIC", "white")
    with pytest.raises(ValueError, match="smooth or leaves"):
        calibration_run(64, 2)(model)


def test_bias_correction_takes_the_weights_rounding_out_of_the_mean_output() -> None:
    """Inputs with a mean far from zero (as a layer norm's affine output can have): the
    weights' rounding shifts every token's output alike; with the mean input given, the
    corrected bias removes that shift, and the error of the token-averaged output drops."""
    g = torch.Generator().manual_seed(4)
    linear = nn.Linear(96, 64)
    offset = torch.randn(96, generator=g) * 3
    x = torch.randn(4000, 96, generator=g) + offset
    plain = Int8DynamicLinear(linear)
    corrected = Int8DynamicLinear(linear, input_mean=x.double().mean(0))
    assert corrected.bias is not None and corrected.bias.dtype == torch.float32
    with torch.no_grad():
        want = linear(x)
        pooled_plain = rel(plain(x).mean(0), want.mean(0))
        pooled_corrected = rel(corrected(x).mean(0), want.mean(0))
        assert pooled_corrected < pooled_plain / 3
        # per token, no worse than without the correction
        assert rel(corrected(x), want) < rel(plain(x), want) * 1.01
    # a Linear without a bias gets one holding the correction
    no_bias = Int8DynamicLinear(nn.Linear(96, 64, bias=False), input_mean=offset)
    assert no_bias.bias is not None and no_bias.bias.shape == (64,)


def test_core_int8_corrects_biases_from_the_calibration_int_mm_does_not() -> None:
    base = tiny_swin()
    floats = {name: m for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    core, old = copy.deepcopy(base), copy.deepcopy(base)
    include = lambda name, layer: ".blocks." in name  # noqa: E731
    quantize_linears(core, "int8", include, calibrate=calibration_run(64, 2))
    quantize_linears(old, "int8", include, backend="int_mm", calibrate=calibration_run(64, 2))
    for model, corrected in ((core, True), (old, False)):
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Int8DynamicLinear)]
        assert len(layers) >= 14
        for name, layer in layers:
            bias = floats[name].bias.detach()
            assert layer.bias is not None
            assert torch.equal(layer.bias, bias) is not corrected, name
            assert rel(layer.bias, bias) < 0.5


def test_gptq_rounding_lowers_the_output_error_on_inputs_like_the_calibration() -> None:
    """Correlated inputs (a few directions dominate, as in real activations): GPTQ's int8
    weights, with round-to-nearest's scales, give a smaller output error on inputs drawn
    like the calibration ones; a never-active input column does not break it."""
    g = torch.Generator().manual_seed(5)
    k, n = 128, 48
    basis = torch.randn(8, k, generator=g)

    def draw(m: int) -> torch.Tensor:
        x = torch.randn(m, 8, generator=g) @ basis + 0.1 * torch.randn(m, k, generator=g)
        x[:, 7] = 0.0  # an input that never fires
        return x

    weight = torch.randn(n, k, generator=g) / k**0.5
    calib = draw(2000)
    q, scale = gptq_int8(weight, calib.t() @ calib)
    nearest_scale = weight.abs().amax(1) / 127
    torch.testing.assert_close(scale, nearest_scale)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    rtn = torch.round(weight / nearest_scale[:, None]).clamp(-127, 127)
    assert not torch.equal(q.float(), rtn)  # rounded differently ...
    test = draw(1000)
    want = test @ weight.t()
    err_gptq = rel(test @ (q.float() * scale[:, None]).t(), want)
    err_rtn = rel(test @ (rtn * nearest_scale[:, None]).t(), want)
    assert err_gptq < err_rtn / 1.5  # ... for a smaller output error
