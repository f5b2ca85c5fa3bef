"""The opt-in fidelity check at start-up (SERVE_FIDELITY_CHECK), for SAM and SAM 2 alike: a
variant that passes serves and exports its measures; one below a floor never becomes ready
and the process exits with the reason. Off by default, and refused without photos to
measure on. SAM 2's served stages against its reference (Meta's predictor semantics,
tests/models/test_sam2_parity.py) with the stability fallback taken and not."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from models.fidelity import compare_sam, eager_sam2_runner, fidelity_prompts, load_photos
from models.optimize import OptimizeOptions
from models.sam2 import SAM2_CONFIGS, load_sam2
from server.engine.sam2_stages import Sam2Stages
from server.settings import Settings
from tests.server.conftest import LiveServer, free_port, small_settings, spawn_server

# (SERVE_SAM_MODEL, the name /v1/models and the measures give it)
SAM_MODELS = [("vit_tiny", "sam_vit_tiny"), ("sam2_test_tiny", "sam2_test_tiny")]


def fidelity_samples(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.labels["model"], s.labels["measure"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "serve_fidelity"
    }


@pytest.mark.parametrize(("model", "name"), SAM_MODELS)
def test_a_faithful_variant_starts_and_exports_its_measures(
    small_photo_dir: Path, model: str, name: str
) -> None:
    settings = small_settings(sam_model=model, fidelity_check=True,
                              fidelity_images=small_photo_dir, fidelity_swin_views=16)  # fmt: skip
    server = LiveServer(settings).start(timeout_s=240)
    try:
        measures = fidelity_samples(server.url)
        # fp32 on the CPU: the served stages compute what the eager model computes
        assert measures[(name, "mask_iou_mean")] > 0.999
        assert measures[(name, "mask_iou_min")] > 0.99
        assert measures[(name, "embedding_rel_error")] < 1e-4
        assert measures[(name, "score_diff_max")] < 1e-3
        assert measures[("swin_test", "top1_agreement")] == 1.0
        assert measures[("swin_test", "logit_rel_error")] < 1e-4
        assert len(measures) == 8
        (png,) = small_photo_dir.glob("*.png")
        files = {"image": ("a.png", png.read_bytes(), "image/png")}
        form = {"request": '{"box": [10, 10, 90, 90]}'}
        ok = httpx.post(server.url + "/v1/segment", files=files, data=form, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()


# a variant that strays from fp32 on each model (SAM 2 refuses int8: settings_cli)
STRAYING = {
    "vit_tiny": {"SERVE_QUANTIZATION": "int8"},
    "sam2_test_tiny": {"SERVE_PRECISION": "bf16"},
}


@pytest.mark.parametrize(("model", "name"), SAM_MODELS)
def test_a_variant_below_the_floor_never_serves(
    small_photo_dir: Path, tmp_path: Path, model: str, name: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": model,
           "SERVE_ENABLE_SWIN": "false", "SERVE_BATCH_BUCKETS": "[1,2]",
           "SERVE_MAX_BATCH_SIZE": "2", "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
           **STRAYING[model], "SERVE_FIDELITY_CHECK": "true",
           "SERVE_FIDELITY_IMAGES": str(small_photo_dir),
           "SERVE_FIDELITY_MAX_EMBEDDING_ERROR": "0.000001"}  # fmt: skip
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = spawn_server(env, port, log)
        try:
            ready = []
            deadline = time.monotonic() + 240
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    ready.append(httpx.get(url + "/readyz", timeout=2).status_code)
                time.sleep(0.1)
            assert proc.wait(timeout=30) == 1, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert 200 not in ready and 503 in ready  # it answered, but never as ready
    assert "below the fidelity floor" in text
    assert f"{name}: embedding error" in text and "> ceiling 1e-06" in text
    assert "fidelity on 3 photos in" in text and f"'{name}': {{'embedding_rel_error'" in text


def test_the_check_is_off_by_default_and_needs_photos() -> None:
    assert Settings().fidelity_check is False
    with pytest.raises(ValidationError, match="SERVE_FIDELITY_IMAGES"):
        Settings(fidelity_check=True)


@pytest.mark.parametrize("fallback", [False, True], ids=["token 0 stable", "fallback"])
def test_sam2_served_stages_answer_as_the_reference(small_photo_dir: Path, fallback: bool) -> None:
    """`Sam2Stages.fidelity_outputs` (the service's square resize, prompt sets, batched
    decoder and upscaling) against `eager_sam2_runner` on the same seeded weights, fp32 on
    the CPU: equal but for rounding. Column 0 is the single-mask answer: token 0 where it is
    stable (every prompt here on these weights), and with a stability threshold no mask
    meets, the best multimask candidate on both sides."""
    config = SAM2_CONFIGS["sam2_test_tiny"]
    if fallback:
        config = replace(config, stability_thresh=1.01)
    cpu = torch.device("cpu")
    stages = Sam2Stages(load_sam2(config, None, seed=0), cpu, OptimizeOptions(), [1], [1, 8])
    photos = load_photos(small_photo_dir)
    result = compare_sam(
        eager_sam2_runner(load_sam2(config, None, seed=0), cpu), stages.fidelity_outputs, photos
    )
    assert (result.photos, result.masks) == (3, 3 * 5 * 4)
    assert result.embedding_rel_error < 1e-6
    assert result.mask_iou_min > 0.999 and result.score_diff_max < 1e-5
    h, w = photos[0].shape[:2]
    scores = stages.fidelity_outputs(photos[0], fidelity_prompts(h, w)).scores
    took_best = scores[:, 0] == scores[:, 1:].max(dim=1).values
    assert bool(took_best.all()) if fallback else not bool(took_best.any())
