"""bench.sam_static_calibration's preparation on SAM's tiny encoder: the service's int8 form
on a copy, the headroom widening the fixed scales and put back after."""

from __future__ import annotations

import torch

from bench.sam_static_calibration import prepared
from models import mlp_static
from models.int8_select import calibration_run
from models.quantize import DynamicQuantLinear
from models.sam import SAM_CONFIGS, load_sam


def _fixed_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: 1.0 / m.input_inv_scale for name, m in model.named_modules()
            if isinstance(m, DynamicQuantLinear) and m.input_inv_scale is not None}  # fmt: skip


def test_the_headroom_widens_each_fixed_scale_and_is_put_back() -> None:
    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    calibrate = calibration_run(base.config.image_size, 1)
    per_token = prepared(base, False, calibrate, 1.0)
    assert not _fixed_scales(per_token)
    assert any(isinstance(m, DynamicQuantLinear) for m in per_token.modules())
    encoder = base.image_encoder
    lin2 = [f"blocks.{i}.mlp.lin2" for i in range(len(encoder.blocks))]
    peaks = mlp_static.input_amax(encoder, lambda: calibrate(encoder), lin2)
    for headroom in (1.0, 2.0):
        # the per-layer choice may keep another lin2 in float at another headroom
        fixed = _fixed_scales(prepared(base, True, calibrate, headroom))
        assert fixed and all(name.endswith("mlp.lin2") for name in fixed)
        for name, scale in fixed.items():
            want = peaks[name.removeprefix("image_encoder.")] * headroom / 127
            torch.testing.assert_close(scale, want)
    assert mlp_static.HEADROOM == 1.5  # the served one, put back
    after = base.state_dict()  # the copies were quantised, not the model
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_max_kept_zero_leaves_no_candidate_in_float() -> None:
    """`--max-kept 0`: the per-layer choice keeps nothing in float, so every Linear of the
    blocks is quantised (what the layers the service keeps in float buy is then the
    difference between the two rows)."""
    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    calibrate = calibration_run(base.config.image_size, 1)
    model = prepared(base, True, calibrate, 1.5, max_kept=0.0)
    floats = [name for name, m in model.image_encoder.blocks.named_modules()
              if type(m) is torch.nn.Linear]  # fmt: skip
    assert not floats, floats


def test_proj_blocks_give_those_projections_fixed_scales_and_are_put_back() -> None:
    """`--proj windowed`: the windowed blocks' output projections take fixed scales beside
    lin2's, the global blocks' keep per-token ones; the switch is put back after."""
    from models import quantize

    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    calibrate = calibration_run(base.config.image_size, 1)
    model = prepared(base, True, calibrate, 1.5, max_kept=0.0, proj_blocks="windowed")
    fixed = _fixed_scales(model)
    blocks = model.image_encoder.blocks
    windowed = {f"image_encoder.blocks.{i}.attn.proj" for i, b in enumerate(blocks) if b.window}
    assert windowed and len(windowed) < len(blocks)
    assert {n for n in fixed if n.endswith("attn.proj")} == windowed
    assert quantize.PROJ_STATIC_BLOCKS == "all"
    # their own headroom (`--proj-headroom`): the scales cover that share of the peaks
    encoder = base.image_encoder
    projs = [f"blocks.{i}.attn.proj" for i in range(len(encoder.blocks))]
    peaks = mlp_static.input_amax(encoder, lambda: calibrate(encoder), projs)
    model = prepared(base, True, calibrate, 1.5, 0.0, "all", 0.75)
    scales = {n: v for n, v in _fixed_scales(model).items() if n.endswith("attn.proj")}
    assert len(scales) == len(projs)
    for name, scale in scales.items():
        torch.testing.assert_close(scale, peaks[name.removeprefix("image_encoder.")] * 0.75 / 127)
    assert quantize.PROJ_HEADROOM == 3.0  # the served one, put back


def test_peak_ratios_name_every_fixed_scale_candidate() -> None:
    """`--peaks`: lin2's and proj's inputs on the photos against the calibration's; the
    same images on both sides give ratios of 1 and no channel past the headroom."""
    from bench.sam_static_calibration import peak_ratios

    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    calibrate = calibration_run(base.config.image_size, 1)
    with torch.inference_mode():
        same = peak_ratios(base.image_encoder, calibrate, calibrate)
        other = peak_ratios(base.image_encoder, calibrate,
                            calibration_run(base.config.image_size, 1, seed=5))  # fmt: skip
    blocks = len(base.image_encoder.blocks)
    assert [r["layer"] for r in same] == [
        *sorted(f"blocks.{i}.mlp.lin2" for i in range(blocks)),
        *(f"blocks.{i}.attn.proj" for i in range(blocks)),
    ]
    assert all(r["max ratio"] == r["median ratio"] == 1.0 and r["share past 1.5x"] == 0
               for r in same)  # fmt: skip
    assert any(r["max ratio"] != 1.0 for r in other)
