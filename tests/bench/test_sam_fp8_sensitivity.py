"""bench.sam_fp8_sensitivity's parts on SAM's tiny encoder: which layers each variant names,
that the fp32 reference is taken before any layer is quantised (the model is shared), and
that int8 errs less than fp8."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from bench.fp8_sensitivity import QuantizedLayers
from bench.sam_fp8_sensitivity import KINDS, layer_names, remembered
from models.fidelity import compare_sam, eager_sam_runner, fidelity_prompts
from models.sam import SAM_CONFIGS, load_sam

CPU = torch.device("cpu")


def _photo(seed: int) -> torch.Tensor:
    """A photo-like image: smooth shapes and noise, not a flat field."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:96, 0:128]
    base = 127 + 80 * np.sin(x / 9.0)[..., None] * np.cos(y / 13.0)[..., None]
    image = base + rng.normal(0, 12, (96, 128, 3))
    return torch.from_numpy(np.clip(image, 0, 255).astype(np.uint8))


def test_variants_name_existing_block_layers() -> None:
    # vit_tiny with four blocks, so that keeping the first and last in float leaves some
    config = dataclasses.replace(
        SAM_CONFIGS["vit_tiny"], encoder_depth=4, encoder_global_attn_indexes=(1, 3)
    )
    model = load_sam(config, None, seed=0)
    modules = dict(model.named_modules())
    for kinds in KINDS.values():
        names = layer_names(model, kinds, skip_ends=False)
        assert len(names) == 4 * len(kinds)
        assert all(isinstance(modules[n], torch.nn.Linear) for n in names)
    inner = layer_names(model, KINDS["mlp"], skip_ends=True)
    blocks = sorted({n.split(".")[2] for n in inner})
    assert blocks == ["1", "2"] and len(inner) == 4


def test_fp8_moves_the_masks_and_the_reference_stays_fp32() -> None:
    model = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    photos = [_photo(0), _photo(1)]
    reference = remembered(eager_sam_runner(model, CPU))
    for photo in photos:
        reference(photo, fidelity_prompts(*photo.shape[:2]))
    candidate = eager_sam_runner(model, CPU)
    with QuantizedLayers(model, layer_names(model, KINDS["all"], skip_ends=False)):
        fp8 = compare_sam(reference, candidate, photos)
    with QuantizedLayers(model, layer_names(model, KINDS["all"], skip_ends=False), "int8"):
        int8 = compare_sam(reference, candidate, photos)
    exact = compare_sam(reference, candidate, photos)  # the hooks gone: fp32 again
    assert exact.embedding_rel_error == 0.0 and exact.mask_iou_mean == 1.0
    assert 0.0 < fp8.embedding_rel_error < 0.5  # e4m3 errs a few percent a product
    assert fp8.mask_iou_min < 1.0 <= exact.mask_iou_min
    # int8's 8 bits a value against e4m3's 3 of mantissa: a smaller error, not none
    assert 0.0 < int8.embedding_rel_error < fp8.embedding_rel_error / 2
    assert fp8.masks == exact.masks == len(photos) * len(fidelity_prompts(96, 128)) * 4


def test_static_int8_is_the_folded_product_and_calibration_sees_each_input() -> None:
    """`calibrate` records each layer's per-channel input peak; `StaticInt8Layers` computes
    the folded product (x over its fixed scales, rounded; the weight's columns times those
    scales, quantised per output channel), and leaves the model as it was on exit."""
    from bench.sam_fp8_sensitivity import StaticInt8Layers, calibrate

    model = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    names = layer_names(model, ("mlp.lin2",), skip_ends=False)
    amax = calibrate(model, names, [_photo(2)])
    layer = dict(model.named_modules())[names[0]]
    assert set(amax) == set(names) and amax[names[0]].shape == (layer.in_features,)
    assert bool((amax[names[0]] > 0).all())
    x = torch.randn(5, layer.in_features) * amax[names[0]] / 3
    plain = layer(x)
    for per_channel in (True, False):
        peak = amax[names[0]] if per_channel else amax[names[0]].max()
        scale = peak.clamp(min=1e-8) / 127.0 * torch.ones(layer.in_features)
        folded = layer.weight.detach() * scale[None, :]
        w_scale = folded.abs().amax(1) / 127.0
        wq = torch.round(folded / w_scale[:, None]).clamp(-127, 127)
        xq = torch.round(x / scale).clamp(-127, 127)
        want = (xq.double() @ wq.double().t()).float() * w_scale + layer.bias.detach()
        with StaticInt8Layers(model, names, amax, per_channel), torch.inference_mode():
            got = layer(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
        assert 0 < float((got - plain).abs().max()) < 0.2 * float(plain.abs().max())
    with torch.inference_mode():
        assert torch.equal(layer(x), plain)  # the hooks gone
