"""SERVE_QUANTIZATION_BACKEND: torchao where it can run the asked quantization, core torch's
layers with a warning where it cannot, and every answer names what runs."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from server.engine.build import optimize_options, swin_options
from server.settings import Settings
from tests.server.conftest import LiveServer, small_settings

CPU = torch.device("cpu")


def test_torchao_is_used_where_it_can_and_core_stands_in_where_not(caplog) -> None:
    int8 = optimize_options(Settings(quantization="int8", quantization_backend="torchao"), CPU)
    assert (int8.quantization_backend, int8.variant) == ("torchao", "fp32+int8+torchao")
    with caplog.at_level(logging.WARNING, logger="server.engine.build"):
        fp8 = optimize_options(Settings(quantization="fp8", quantization_backend="torchao"), CPU)
    assert (fp8.quantization_backend, fp8.variant) == ("core", "fp32+fp8")
    assert "torchao's fp8 needs CUDA" in caplog.text
    # no quantization: nothing for a backend to do, and nothing said
    plain = optimize_options(Settings(quantization_backend="torchao"), CPU)
    assert plain.variant == "fp32"
    assert Settings().quantization_backend == "core"


def test_int8_on_a_gpu_quantises_in_the_layer_norms() -> None:
    """The variant measured right on an H100 (norm_quant), chosen without a GPU here: the
    options are resolved from the device's type alone."""
    cuda = torch.device("cuda")
    int8 = optimize_options(Settings(quantization="int8"), cuda)
    assert int8.norm_quant and "+int8+lnq" in int8.variant, int8.variant
    # SAM's MLPs by fixed scales, its proj adding the residual; Swin's per token (measured
    # so), and Swin has no `Block.residual_in_proj`
    assert int8.mlp_static and int8.variant.startswith("bf16+int8+lnq+static+pres"), int8.variant
    swin = swin_options(Settings(quantization="int8"), int8, cuda)
    assert not swin.mlp_static and swin.variant == "fp16+int8+lnq+tanh_gelu", swin.variant
    assert not swin.proj_residual
    assert not optimize_options(Settings(quantization="int8"), CPU).norm_quant
    assert not optimize_options(Settings(quantization="int8"), CPU).mlp_static
    assert not optimize_options(Settings(quantization="int8"), CPU).proj_residual
    assert not optimize_options(Settings(quantization="fp8"), cuda).norm_quant
    assert not optimize_options(Settings(), cuda).norm_quant


@pytest.fixture(scope="module")
def torchao_server():
    server = LiveServer(small_settings(quantization="int8", quantization_backend="torchao"))
    yield server.start(timeout_s=240)
    server.stop()


def test_a_torchao_int8_service_serves_and_says_so(torchao_server, png_bytes) -> None:
    with httpx.Client(base_url=torchao_server.url, timeout=60) as c:
        models = c.get("/v1/models").json()["models"]
        assert {m["name"]: m["precision"] for m in models} == {
            "sam_vit_tiny": "fp32+int8+torchao",
            "swin_test": "fp32+int8+torchao",
        }
        segment = c.post("/v1/segment", files={"image": ("a.png", png_bytes, "image/png")},
                         data={"request": '{"box": [10, 10, 90, 90]}'})  # fmt: skip
        assert segment.status_code == 200, segment.text
        assert segment.json()["model"]["precision"] == "fp32+int8+torchao"
        classify = c.post("/v1/classify", files={"image": ("a.png", png_bytes, "image/png")})
        assert classify.status_code == 200, classify.text
        assert classify.json()["model"]["precision"] == "fp32+int8+torchao"


@pytest.fixture(scope="module")
def int8_sam_server():
    server = LiveServer(small_settings(quantization="int8", swin_quantization="none"))
    yield server.start(timeout_s=240)
    server.stop()


def test_swin_takes_its_own_quantisation(int8_sam_server, png_bytes) -> None:
    """SERVE_SWIN_QUANTIZATION=none beside SERVE_QUANTIZATION=int8: int8 SAM, float Swin,
    each response saying which."""
    with httpx.Client(base_url=int8_sam_server.url, timeout=60) as c:
        models = c.get("/v1/models").json()["models"]
        assert {m["name"]: m["precision"] for m in models} == {
            "sam_vit_tiny": "fp32+int8",
            "swin_test": "fp32",
        }
        files = {"image": ("a.png", png_bytes, "image/png")}
        classify = c.post("/v1/classify", files=files)
        assert classify.status_code == 200, classify.text
        assert classify.json()["model"]["precision"] == "fp32"
        segment = c.post("/v1/segment", files=files, data={"request": '{"box": [10, 10, 90, 90]}'})
        assert segment.status_code == 200, segment.text
        assert segment.json()["model"]["precision"] == "fp32+int8"
