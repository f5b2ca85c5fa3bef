"""SERVE_CALIBRATION_IMAGES: int8 calibrates on photos like the served ones instead of
synthetic images (the per-layer choice, GPTQ, bias correction, SAM's fixed MLP scales).
The inputs each model gets from the folder, the scales they set, a missing folder named
before start, and a real int8 service that calibrated on the photos and serves."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import httpx
import pytest
import torch

from models import mlp_static
from models.optimize import OptimizeOptions, prepare_sam_encoder
from models.quantize import DynamicQuantLinear
from models.sam import SAM_CONFIGS, load_sam
from models.sam import transforms as sam_tf
from models.swin import SWIN_CONFIGS
from models.swin import transforms as swin_tf
from server.engine.services import CALIBRATION_PHOTOS, calibration_inputs
from server.settings import Settings
from server.settings_cli import model_problems
from tests.server.conftest import LiveServer, small_settings

INT8 = OptimizeOptions(quantization="int8")


def test_each_model_gets_the_photos_as_its_own_inputs(small_photo_dir: Path) -> None:
    settings = small_settings(quantization="int8", calibration_images=small_photo_dir)
    sam, swin = SAM_CONFIGS["vit_tiny"], SWIN_CONFIGS["swin_test"]
    x = calibration_inputs(settings, INT8,
                           lambda p: sam_tf.preprocess_images(p, sam, "cpu")[0])  # fmt: skip
    assert x is not None and x.shape == (3, 3, sam.image_size, sam.image_size)
    y = calibration_inputs(settings, INT8, lambda p: swin_tf.preprocess_images(p, swin, "cpu"))
    assert y is not None and y.shape == (3, 3, swin.img_size, swin.img_size)
    assert CALIBRATION_PHOTOS >= 3
    # nothing to calibrate, or nothing given: synthetic images (None)
    assert calibration_inputs(settings, OptimizeOptions(), lambda p: torch.zeros(1)) is None
    plain = small_settings(quantization="int8")
    assert calibration_inputs(plain, INT8, lambda p: torch.zeros(1)) is None


def test_the_fixed_mlp_scales_are_the_photos_peaks(small_photo_dir: Path) -> None:
    """With `calibration`, SAM's fixed MLP scales are each lin2 input's peak over those
    inputs (times the headroom), not over the synthetic images."""
    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    settings = small_settings(quantization="int8", calibration_images=small_photo_dir)
    photos = calibration_inputs(
        settings, INT8, lambda p: sam_tf.preprocess_images(p, base.config, "cpu")[0]
    )
    assert photos is not None
    encoder = base.image_encoder
    lin2 = [f"blocks.{i}.mlp.lin2" for i in range(len(encoder.blocks))]
    peaks = mlp_static.input_amax(encoder, lambda: encoder(photos), lin2)
    # no layer in float: the per-layer choice, measured on other images, keeps another
    options = OptimizeOptions(quantization="int8", norm_quant=True, mlp_static=True, keep_float=0.0)
    scales: dict[str, dict[str, torch.Tensor]] = {}
    for label, given in (("photos", photos), ("synthetic", None)):
        model = copy.deepcopy(base)
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"), given)
        inverse = {n: m.input_inv_scale for n, m in model.image_encoder.named_modules()
                   if isinstance(m, DynamicQuantLinear)}  # fmt: skip
        scales[label] = {n: 1.0 / inv for n, inv in inverse.items() if inv is not None}
    assert scales["photos"]
    for name, scale in scales["photos"].items():
        torch.testing.assert_close(scale, peaks[name] * mlp_static.HEADROOM / 127)
    common = scales["photos"].keys() & scales["synthetic"].keys()
    assert common == set(lin2)
    assert any(not torch.equal(scales["photos"][n], scales["synthetic"][n]) for n in common)


def test_a_missing_folder_is_named_before_start(tmp_path: Path) -> None:
    settings = Settings(calibration_images=tmp_path / "nowhere")
    problems = model_problems(settings)
    assert any("SERVE_CALIBRATION_IMAGES" in p and "no such file" in p for p in problems)


@pytest.fixture(scope="module")
def calibrated_server(small_photo_dir: Path):
    settings = small_settings(quantization="int8", calibration_images=small_photo_dir,
                              log_level="INFO")  # fmt: skip
    server = LiveServer(settings)
    yield server.start(timeout_s=240)
    server.stop()


def test_an_int8_service_calibrated_on_photos_serves(
    calibrated_server: LiveServer, png_bytes: bytes
) -> None:
    with httpx.Client(base_url=calibrated_server.url, timeout=60) as c:
        models = {m["name"]: m["precision"] for m in c.get("/v1/models").json()["models"]}
        assert models == {"sam_vit_tiny": "fp32+int8", "swin_test": "fp32+int8"}
        files = {"image": ("a.png", png_bytes, "image/png")}
        segment = c.post("/v1/segment", files=files, data={"request": '{"box": [10, 10, 90, 90]}'})
        assert segment.status_code == 200, segment.text
        classify = c.post("/v1/classify", files=files)
        assert classify.status_code == 200, classify.text


def test_the_service_says_what_it_calibrated_on(small_photo_dir: Path, caplog) -> None:
    """Both models' loads name the folder and the photos taken (the engine's log)."""
    settings = small_settings(quantization="int8", calibration_images=small_photo_dir)
    with caplog.at_level(logging.INFO, logger="server.engine.services"):
        calibration_inputs(settings, INT8, lambda p: torch.stack([q[:1, :1, 0] for q in p]))
    assert f"int8/fp8 calibrate on 3 photos from {small_photo_dir}" in caplog.text
    assert "flatter" not in caplog.text
    # checked on the photos it calibrated on: said, since the check's figures then flatter
    same = small_settings(quantization="int8", calibration_images=small_photo_dir,
                          fidelity_check=True, fidelity_images=small_photo_dir)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="server.engine.services"):
        calibration_inputs(same, INT8, lambda p: torch.stack([q[:1, :1, 0] for q in p]))
    assert "SERVE_CALIBRATION_IMAGES and SERVE_FIDELITY_IMAGES are one folder" in caplog.text
