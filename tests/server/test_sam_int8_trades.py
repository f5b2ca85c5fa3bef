"""SERVE_SAM_KEEP_FLOAT and SERVE_SAM_PROJ_SCALES: the two trades of SAM's int8 mask
fidelity for encoder speed. Each reaches SAM's encoder (the layers it leaves in float, the
projections' fixed scales) and not Swin's, is named in the variant every answer carries,
and is refused at start where it would mean nothing."""

from __future__ import annotations

import httpx
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from models import quantize
from models.optimize import prepare_sam_encoder
from models.quant_linear import DynamicQuantLinear
from models.quantize import attention_projections
from models.sam import SAM_CONFIGS, load_sam
from server.engine.build import optimize_options, swin_options
from server.settings import Settings
from tests.server.conftest import LiveServer, small_settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FAST = {"quantization": "int8", "sam_proj_scales": "fixed", "sam_keep_float": 0.0}


def test_the_settings_reach_sams_options_and_not_swins() -> None:
    """Resolved from the device's type alone, so the GPU's options are checked here."""
    fast = optimize_options(Settings(**FAST), CUDA)  # type: ignore[arg-type]
    assert fast.proj_static and fast.keep_float == 0.0
    assert fast.variant == "bf16+int8+lnq+static+pres+pstatic+keep0+tanh_gelu", fast.variant
    swin = swin_options(Settings(**FAST), fast, CUDA)  # type: ignore[arg-type]
    assert not swin.proj_static and swin.keep_float is None
    assert swin.variant == "fp16+int8+lnq+tanh_gelu", swin.variant
    # asked for the other way, the measured form that keeps the masks closest
    closest = Settings(quantization="int8", sam_proj_scales="per_token", sam_keep_float=0.125)
    kept = optimize_options(closest, CUDA)
    assert not kept.proj_static and kept.keep_float == 0.125
    assert kept.variant == "bf16+int8+lnq+static+pres+keep0.125+tanh_gelu", kept.variant
    some = optimize_options(Settings(quantization="fp8", sam_keep_float=0.25), CUDA)
    assert some.keep_float == 0.25 and "+keep0.25" in some.variant, some.variant


def test_left_unset_they_are_taken_where_they_were_measured() -> None:
    """ViT-B's int8 encoder on CUDA: both trades (608.5 against 556.6 img/s at mask IoU
    0.9863 on an H100, docs/BENCHMARKS.md); anywhere else neither, as before."""
    served = optimize_options(Settings(quantization="int8"), CUDA)
    assert served.proj_static and served.keep_float == 0.0
    assert served.variant == "bf16+int8+lnq+static+pres+pstatic+keep0+tanh_gelu"
    one_way = optimize_options(Settings(quantization="int8", sam_proj_scales="per_token"), CUDA)
    assert not one_way.proj_static and one_way.keep_float == 0.0
    other = optimize_options(Settings(quantization="int8", sam_keep_float=0.125), CUDA)
    assert other.proj_static and other.keep_float == 0.125
    for unmeasured in (
        optimize_options(Settings(quantization="int8"), CPU),
        optimize_options(Settings(quantization="int8", sam_model="vit_h"), CUDA),
        optimize_options(Settings(quantization="fp8"), CUDA),
        optimize_options(Settings(quantization="int8", quantization_backend="torchao"), CUDA),
        optimize_options(Settings(), CUDA),
    ):
        assert not unmeasured.proj_static and unmeasured.keep_float is None, unmeasured.variant
        assert "pstatic" not in unmeasured.variant and "keep" not in unmeasured.variant


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"sam_proj_scales": "fixed"}, "SERVE_QUANTIZATION=int8"),
        ({"sam_proj_scales": "fixed", "quantization": "fp8"}, "SERVE_QUANTIZATION=int8"),
        ({**FAST, "quantization_backend": "torchao"}, "SERVE_QUANTIZATION_BACKEND=core"),
        ({**FAST, "sam_model": "sam2.1_hiera_tiny"}, "not SAM 2's Hiera"),
        (
            {"quantization": "int8", "sam_keep_float": 0.0, "sam_model": "sam2.1_hiera_tiny"},
            "SERVE_SAM_KEEP_FLOAT: for SAM's ViT encoders",
        ),
        ({"quantization": "int8", "sam_keep_float": -0.1}, "sam_keep_float"),
        ({"quantization": "int8", "sam_keep_float": 1.5}, "sam_keep_float"),
        ({"sam_keep_float": 0.0}, "SERVE_SAM_KEEP_FLOAT needs SERVE_QUANTIZATION"),
        (
            {"quantization": "int8", "quantization_backend": "torchao", "sam_keep_float": 0.0},
            "SERVE_SAM_KEEP_FLOAT needs",
        ),
    ],
)
def test_a_setting_that_would_mean_nothing_is_refused(given: dict, named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**given)
    assert named in str(caught.value)


def _encoder(options_settings: Settings) -> nn.Module:
    encoder = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval().image_encoder
    options = optimize_options(options_settings, CPU)
    prepare_sam_encoder(encoder, options, CPU, None)
    return encoder


def test_no_layer_in_float_and_the_projections_fixed_scales() -> None:
    """SERVE_SAM_KEEP_FLOAT=0: every block Linear int8, none left for the per-layer choice
    to keep; SERVE_SAM_PROJ_SCALES=fixed: every attention projection with its input's
    scales set at load, by which the attention writes it int8."""
    fast = _encoder(Settings(**FAST))  # type: ignore[arg-type]
    layers = {n: m for n, m in fast.named_modules() if n.startswith("blocks.")}
    assert not [n for n, m in layers.items() if isinstance(m, nn.Linear)]  # none in float
    quantised = [n for n, m in layers.items() if isinstance(m, DynamicQuantLinear)]
    assert len(quantised) == 4 * len(fast.blocks), quantised  # qkv, proj, lin1, lin2
    projections = attention_projections(fast)
    assert len(projections) == len(fast.blocks)
    for name in projections:
        scales = layers[name].input_inv_scale
        assert scales is not None and bool((scales > 0).all()), name
    served = _encoder(Settings(quantization="int8"))
    proj = dict(served.named_modules())[projections[0]]
    assert getattr(proj, "input_inv_scale", None) is None  # per token, as served


@pytest.mark.parametrize(("share", "kept"), [(None, 1), (0.0, 0), (0.5, 4)])
def test_the_share_bounds_the_layers_kept_in_float(
    share: float | None, kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer measured past the error bar (none is, on the tiny test model): the
    per-layer choice keeps as many as the share allows of the 8 (2 blocks of 4), 1/8
    unset."""
    monkeypatch.setattr(quantize, "INT8_MAX_ERROR", 0.0)
    encoder = _encoder(Settings(quantization="int8", sam_keep_float=share))
    floats = [n for n, m in encoder.named_modules()
              if n.startswith("blocks.") and isinstance(m, nn.Linear)]  # fmt: skip
    assert len(floats) == kept, floats


@pytest.fixture(scope="module")
def fast_server():
    server = LiveServer(small_settings(**FAST))
    yield server.start(timeout_s=240)
    server.stop()


def test_a_service_with_both_trades_serves_and_says_so(
    fast_server: LiveServer, png_bytes: bytes
) -> None:
    with httpx.Client(base_url=fast_server.url, timeout=60) as c:
        models = c.get("/v1/models").json()["models"]
        assert {m["name"]: m["precision"] for m in models} == {
            "sam_vit_tiny": "fp32+int8+pstatic+keep0",
            "swin_test": "fp32+int8",
        }
        files = {"image": ("a.png", png_bytes, "image/png")}
        segment = c.post("/v1/segment", files=files, data={"request": '{"box": [10, 10, 90, 90]}'})
        assert segment.status_code == 200, segment.text
        assert segment.json()["model"]["precision"] == "fp32+int8+pstatic+keep0"
        assert segment.json()["results"][0]["masks"]
