"""The opt-in fidelity check at start-up (SERVE_FIDELITY_CHECK): a variant that passes
serves and exports its measures; one below a floor never becomes ready and the process
exits with the reason. Off by default, and refused without photos to measure on."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from server.settings import Settings
from tests.server.conftest import LiveServer, free_port, small_settings, spawn_server


def fidelity_samples(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.labels["model"], s.labels["measure"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "serve_fidelity"
    }


def test_a_faithful_variant_starts_and_exports_its_measures(small_photo_dir: Path) -> None:
    settings = small_settings(fidelity_check=True, fidelity_images=small_photo_dir,
                              fidelity_swin_views=16)  # fmt: skip
    server = LiveServer(settings).start(timeout_s=240)
    try:
        measures = fidelity_samples(server.url)
        # fp32 on the CPU: the served stages compute what the eager model computes
        assert measures[("sam_vit_tiny", "mask_iou_mean")] > 0.999
        assert measures[("sam_vit_tiny", "embedding_rel_error")] < 1e-4
        assert measures[("sam_vit_tiny", "score_diff_max")] < 1e-3
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


def test_a_variant_below_the_floor_never_serves(small_photo_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_ENABLE_SWIN": "false", "SERVE_BATCH_BUCKETS": "[1,2]",
           "SERVE_MAX_BATCH_SIZE": "2", "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
           "SERVE_QUANTIZATION": "int8", "SERVE_FIDELITY_CHECK": "true",
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
    assert "sam_vit_tiny: embedding error" in text and "> ceiling 1e-06" in text


def test_the_check_is_off_by_default_and_needs_photos() -> None:
    assert Settings().fidelity_check is False
    with pytest.raises(ValidationError, match="SERVE_FIDELITY_IMAGES"):
        Settings(fidelity_check=True)
