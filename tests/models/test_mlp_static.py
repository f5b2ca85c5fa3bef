"""The MLP's hidden activation handed from lin1 to lin2 in int8 by fixed per-channel scales
calibrated at load (models.mlp_static): the folding is exact, the first Linear writes what
the second would have quantised, an outlier channel costs only itself, and SAM's encoder
keeps per-token int8's fidelity, eager and compiled."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.int8_select import measure_int8
from models.mlp_static import HEADROOM, input_amax, quantize_static, static_scale
from models.optimize import OptimizeOptions, prepare_sam_encoder
from models.quantize import DynamicQuantLinear, quantize_linears
from models.sam import Sam
from models.sam.common import MLPBlock


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _everything(name: str, layer: nn.Linear) -> bool:
    return True


def test_fixed_scales_round_half_to_even_and_saturate() -> None:
    inv = torch.tensor([1.0, 2.0, 0.5])
    x = torch.tensor([[0.5, 0.75, 300.0], [-1.5, -200.0, 3.0]])
    assert quantize_static(x, inv).tolist() == [[0, 2, 127], [-2, -127, 2]]
    # the calibration's peak times the headroom: values up to 1.5x it stay unsaturated
    want = torch.tensor([1.0, 1e-8 / 127]) * HEADROOM
    torch.testing.assert_close(static_scale(torch.tensor([127.0, 0.0])), want)


def test_the_first_linear_writes_exactly_what_the_second_would_quantise() -> None:
    """lin1's int8 output (its epilogue's rounding by lin2's scales) against lin1 in float
    and lin2 quantising that itself: the same numbers, so fusing changes nothing."""
    torch.manual_seed(0)
    mlp = MLPBlock(64, 256).eval()
    x = torch.randn(5, 9, 64, generator=torch.Generator().manual_seed(1))
    fused = copy.deepcopy(mlp)
    quantize_linears(fused, "int8", _everything, calibrate=lambda m: m(x), max_kept=0.0,
                     mlp_static=True)  # fmt: skip
    assert isinstance(fused.lin1, DynamicQuantLinear) and isinstance(fused.lin2, DynamicQuantLinear)
    assert fused.lin2.input_inv_scale is not None
    assert fused.lin1.output_inv_scale is fused.lin2.input_inv_scale
    assert isinstance(fused.act, nn.Identity) and fused.lin1.gelu
    unfused = copy.deepcopy(fused)
    unfused.lin1.output_inv_scale = None
    with torch.inference_mode():
        hidden = fused.lin1(x)
        assert hidden.dtype == torch.int8 and hidden.shape == (5, 9, 256)
        assert torch.equal(hidden, quantize_static(unfused.lin1(x), fused.lin2.input_inv_scale))
        torch.testing.assert_close(fused(x), unfused(x), rtol=0, atol=0)
        want, got = mlp(x), fused(x)
        # the calibration's own inputs: nothing saturates, int8's usual error
        assert 0 < _rel(got, want) < 0.03
        # the residual in lin2's epilogue, as the blocks hand it
        r = torch.randn(5, 9, 64)
        torch.testing.assert_close(fused(x, residual=r), got + r, rtol=1e-6, atol=1e-6)


def test_the_calibration_records_each_channels_peak() -> None:
    layer = nn.Linear(8, 4)
    xs = [torch.randn(3, 8), torch.randn(2, 5, 8) * 3]
    amax = input_amax(layer, lambda: [layer(x) for x in xs], [""])
    want = torch.maximum(xs[0].abs().amax(0), xs[1].abs().reshape(-1, 8).amax(0))
    assert torch.equal(amax[""], want)
    assert not layer._forward_pre_hooks  # the hooks are gone


def test_an_outlier_channel_costs_fixed_scales_what_it_costs_per_token() -> None:
    """Per token, one large channel sets every row's scale and leaves the others few levels.
    With fixed per-channel scales the input keeps every channel's levels, but the scale
    folded into the weight makes that channel's column the largest of every weight row: the
    difficulty moves to the weights (SmoothQuant's migration strength 1), about as costly.
    The per-layer choice measures the fixed-scale form where the layer will run so
    (`static`), and the plain form where it will not."""
    layer = nn.Linear(256, 32)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    x[:, 7] *= 60
    amax = input_amax(layer, lambda: layer(x), [""])
    rows = measure_int8(layer, lambda: layer(x), _everything).errors[""]
    fixed = measure_int8(layer, lambda: layer(x), _everything, static=amax)
    assert 0.7 * rows < fixed.errors[""] < 1.3 * rows, (fixed.errors, rows)
    calm = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    plain = measure_int8(layer, lambda: layer(calm), _everything).errors[""]
    assert plain < 0.5 * rows  # without the outlier: int8's usual error, for scale
    # the statistics for bias correction and GPTQ: the scaled input's
    inv = 1.0 / static_scale(amax[""])
    torch.testing.assert_close(fixed.input_means[""].float(), (x * inv).mean(0), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="int8 only"):
        measure_int8(layer, lambda: layer(x), _everything, kind="fp8", static=amax)


def test_fixed_scales_are_refused_where_they_cannot_be_measured() -> None:
    mlp = MLPBlock(64, 256)
    with pytest.raises(ValueError, match="mlp_static"):
        quantize_linears(copy.deepcopy(mlp), "int8", _everything, mlp_static=True)
    with pytest.raises(ValueError, match="mlp_static"):
        quantize_linears(copy.deepcopy(mlp), "fp8", _everything, mlp_static=True,
                         calibrate=lambda m: m(torch.randn(4, 64)))  # fmt: skip


def test_sam_encoder_mlps_hand_lin2_its_input_by_fixed_scales(tiny_sam: Sam) -> None:
    """The served form (the norms quantising qkv's and lin1's input, GELU in lin1), with
    lin2's scales calibrated on `smooth_images` as at load. On other images of that kind the
    error is per-token int8's, about; white noise, far from any photo, reaches up to 2.5x
    the calibrated peaks and saturates, which costs it more than per-token scales."""
    from models.int8_select import smooth_images

    images = smooth_images(2, 256, seed=7)  # the calibration's are seed 0
    noise = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(2))
    outputs = []
    models = []
    for static in (False, True):
        model = copy.deepcopy(tiny_sam)
        options = OptimizeOptions(quantization="int8", norm_quant=True, mlp_static=static)
        assert options.variant == ("fp32+int8+lnq+static" if static else "fp32+int8+lnq")
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"))
        blocks = model.image_encoder.blocks
        pairs = [(b.mlp.lin1, b.mlp.lin2) for b in blocks]
        both = [(a, b) for a, b in pairs if isinstance(a, DynamicQuantLinear)
                and isinstance(b, DynamicQuantLinear)]  # fmt: skip
        assert both
        for first, second in both:
            assert (first.output_inv_scale is not None) == static
            assert (second.input_inv_scale is not None) == static
        with torch.inference_mode():
            outputs.append((model.encode(images), model.encode(noise)))
        models.append(model)
    with torch.inference_mode():
        want, want_noise = tiny_sam.encode(images), tiny_sam.encode(noise)
        compiled = torch.compile(models[1].encode, fullgraph=True, dynamic=False)(images)
    errors = [_rel(o, want) for o, _ in outputs]
    assert 0 < errors[1] < 1.25 * errors[0] and errors[1] < 0.03, errors
    noisy = [_rel(o, want_noise) for _, o in outputs]
    assert noisy[0] < noisy[1] < 3 * noisy[0] and noisy[1] < 0.05, noisy
    assert _rel(compiled, outputs[1][0]) < 1e-3


def test_the_attention_residual_can_go_into_the_projections_epilogue(tiny_sam: Sam) -> None:
    """`proj_residual`: a quantised `proj` adds the block's residual in its epilogue (no
    add pass before the quantising norm); the encoder gives what it gave with the add
    outside, eager and compiled. Partitioned windows keep the add outside."""
    from models.int8_select import smooth_images

    images = smooth_images(2, 256, seed=7)
    outputs = []
    for fused in (False, True):
        model = copy.deepcopy(tiny_sam)
        options = OptimizeOptions(quantization="int8", norm_quant=True, mlp_static=True,
                                  proj_residual=fused)  # fmt: skip
        assert options.variant.endswith("+pres") == fused
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"))
        blocks = model.image_encoder.blocks
        assert [b.residual_in_proj for b in blocks] == [fused] * len(blocks)
        assert any(isinstance(b.attn.proj, DynamicQuantLinear) and b.window == 0
                   for b in blocks)  # fmt: skip
        with torch.inference_mode():
            outputs.append(model.encode(images))
            if fused:
                compiled = torch.compile(model.encode, fullgraph=True, dynamic=False)(images)
    assert _rel(outputs[1], outputs[0]) < 1e-5
    assert _rel(compiled, outputs[1]) < 1e-3
    # no quantised layers, no change: the float projection adds it after, as before
    plain = copy.deepcopy(tiny_sam)
    prepare_sam_encoder(plain.image_encoder, OptimizeOptions(proj_residual=True),
                        torch.device("cpu"))  # fmt: skip
    assert not any(b.residual_in_proj for b in plain.image_encoder.blocks)


def test_the_output_projections_take_their_input_by_fixed_scales(tiny_sam: Sam) -> None:
    """`proj_static`: each quantised attention projection takes its input by fixed
    per-channel scales calibrated at load (the attention kernels write it int8 on CUDA; here
    the projection quantises the float input itself); the encoder's error stays within
    1.5x that of per-token scales, eager and compiled alike."""
    from unittest.mock import patch

    from models import quantize
    from models.int8_select import smooth_images
    from models.quantize import attention_projections

    images = smooth_images(2, 256, seed=7)
    outputs = []
    for fixed in (False, True):
        model = copy.deepcopy(tiny_sam)
        options = OptimizeOptions(quantization="int8", norm_quant=True, mlp_static=True,
                                  proj_residual=True, proj_static=fixed)  # fmt: skip
        assert options.variant.endswith("+pstatic") == fixed
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"))
        blocks = model.image_encoder.blocks
        projs = [b.attn.proj for b in blocks if isinstance(b.attn.proj, DynamicQuantLinear)]
        assert projs
        assert all((p.input_inv_scale is not None) == fixed for p in projs)
        assert all((b.attn._proj_inv_scale() is not None) == (fixed and p in projs)
                   for b in blocks for p in [b.attn.proj])  # fmt: skip
        with torch.inference_mode():
            outputs.append(model.encode(images))
            if fixed:
                compiled = torch.compile(model.encode, fullgraph=True, dynamic=False)(images)
                served = {id(p): p.input_inv_scale for p in projs}
    # the projections' own headroom: 0.75 scales their inverse scales by 3 / 0.75, only theirs
    halved = copy.deepcopy(tiny_sam)
    with patch.object(quantize, "PROJ_HEADROOM", 0.75):
        prepare_sam_encoder(halved.image_encoder, options, torch.device("cpu"))
    compared = 0
    for ours, theirs in zip(halved.image_encoder.blocks, model.image_encoder.blocks, strict=True):
        if id(theirs.attn.proj) in served and isinstance(ours.attn.proj, DynamicQuantLinear):
            torch.testing.assert_close(ours.attn.proj.input_inv_scale,
                                       4 * served[id(theirs.attn.proj)])  # fmt: skip
            compared += 1
        if isinstance(ours.mlp.lin2, DynamicQuantLinear) and isinstance(
            theirs.mlp.lin2, DynamicQuantLinear
        ):
            assert torch.equal(ours.mlp.lin2.input_inv_scale, theirs.mlp.lin2.input_inv_scale)
    assert compared
    blocks = tiny_sam.image_encoder.blocks
    assert attention_projections(tiny_sam.image_encoder) == [
        f"blocks.{i}.attn.proj" for i in range(len(blocks))
    ]
    for which, windowed in (("windowed", True), ("global", False)):
        with patch.object(quantize, "PROJ_STATIC_BLOCKS", which):
            names = attention_projections(tiny_sam.image_encoder)
        want = [f"blocks.{i}.attn.proj" for i, b in enumerate(blocks) if (b.window > 0) == windowed]
        assert names == want and want
    with torch.inference_mode():
        want = tiny_sam.encode(images)
    errors = [_rel(o, want) for o in outputs]
    # the projections' 3x headroom (photos pass the smooth images' peaks) makes their steps
    # twice lin2's: on images of the calibration's own kind, 1.36x per-token's error here
    assert 0 < errors[1] < 1.5 * errors[0] and errors[1] < 0.03, errors
    assert _rel(compiled, outputs[1]) < 1e-3
    with pytest.raises(ValueError, match="proj_static"):
        quantize_linears(copy.deepcopy(tiny_sam.image_encoder), "int8", _everything,
                         proj_static=True)  # fmt: skip


def test_the_attention_ops_say_int8_to_the_compiler_where_scales_are_given() -> None:
    """The ops' fake outputs (what torch.compile plans with) carry the dtype the kernels
    write: int8 with `out_inv_scale`, the input's otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from models.sam.fused_attention import fused_rel_pos_attention, fused_window_attention

    with FakeTensorMode():
        qkv = torch.empty(2, 64, 3, 2, 16, dtype=torch.bfloat16)
        table = torch.empty(15, 16, dtype=torch.bfloat16)
        inv = torch.empty(32)
        assert fused_rel_pos_attention(qkv, table, table).dtype == torch.bfloat16
        assert fused_rel_pos_attention(qkv, table, table, inv).dtype == torch.int8
        windows = fused_window_attention(qkv, table, table, None, 8, 8, inv)
        assert windows.dtype == torch.int8 and windows.shape == (2, 64, 32)
