"""bench/everything_stages.py's CPU smoke: every stage is timed, the wrappers leave the
generator as they found it, and the timed stages account for the timed total."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import models.sam.automatic_pipeline as pipeline
from bench.common import load_photos
from bench.everything_stages import STAGES, StageClock, build, clocked, main, parse_args


@pytest.mark.parametrize("model", ["sam2_test_tiny", "vit_tiny"])
def test_cpu_smoke_times_every_stage(model: str, small_jpeg_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    args = ["--device", "cpu", "--model", model, "--no-compile", "--photos", "1"]
    args += ["--images", str(small_jpeg_dir), "--points-per-side", "4", "--dtypes", "fp32"]
    # random weights: thresholds at 0 so candidates reach NMS and the painted masks
    args += ["--pred-iou-thresh", "0", "--stability-thresh", "0", "--top", "3"]
    payload = main([*args, "--out", str(out)])
    assert json.loads(out.read_text())["dtypes"].keys() == {"fp32"}

    result = payload["dtypes"]["fp32"]
    summary, rows = result["summary"], {r["stage"]: r for r in result["stages"]}
    assert set(rows) == set(STAGES)
    # 16 points in one chunk: one encode, one decoder call, one NMS, one paint
    for stage in ("encode", "decoder", "measure", "nms", "paint", "to host"):
        assert rows[stage]["calls_per_photo"] == 1, stage
        assert rows[stage]["ms_per_photo"] > 0, stage
    assert summary["candidates_per_photo"] == 16 * 3  # every point's 3 masks passed
    assert summary["kept_last_photo"] >= 1
    parts = sum(r["ms_per_photo"] for r in rows.values())
    assert parts <= summary["timed_total_ms_per_photo"] * 1.001
    assert parts >= 0.8 * summary["timed_total_ms_per_photo"]  # the stages are the time


def test_clocked_restores_the_generator_and_the_nms(small_jpeg_dir: Path) -> None:
    args = parse_args(["--device", "cpu", "--model", "sam2_test_tiny", "--no-compile",
                       "--points-per-side", "2"])  # fmt: skip
    generator = build(args, torch.float32)
    methods = {n: getattr(generator, n) for n in ("_encode", "_decode", "_measure", "finish")}
    nms = pipeline.batched_nms
    photo = load_photos(small_jpeg_dir)[0]
    clock = StageClock(torch.device("cpu"))
    with torch.inference_mode(), clocked(generator, clock):
        generator.generate(photo)
    assert clock.calls["encode"] == 1 and clock.calls["decoder"] == 1
    assert pipeline.batched_nms is nms
    assert {n: getattr(generator, n) for n in methods} == methods
    assert "_encode" not in vars(generator)


def _paths(*flags: str) -> tuple[bool, bool, bool]:
    args = parse_args(["--device", "cpu", "--model", "sam2_test_tiny", "--no-compile", *flags])
    model = build(args, torch.float32).model  # type: ignore[attr-defined]
    attention = model.sam_mask_decoder.transformer.layers[0].cross_attn_image_to_token
    return model.sam_mask_decoder.fused_upscale, attention.fused, model.share_image


def test_the_decoder_path_flags_are_set_on_the_model() -> None:
    """bench/gpu_sam2_decoder_paths.sh's flags reach the model they are meant for, both
    ways; without them the model takes the service's paths for the device (on the CPU the
    kernels stay off: they compile on CUDA only, and the interpreter is for tests)."""
    assert _paths("--fused-upscale", "--fused-attention", "--share-image") == (True,) * 3
    assert _paths("--no-fused-upscale", "--no-fused-attention", "--no-share-image") == (
        False,
    ) * 3  # fmt: skip
    assert _paths() == (False, False, True)
