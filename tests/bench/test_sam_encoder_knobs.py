"""bench.sam_encoder's runtime switches: a variant's module globals hold for its whole run
and are put back after, so variants with and without them compare in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sam_encoder import PAIRED, VARIANTS, _variant, runtime_knobs
from models import gemm_gluon, gemm_persistent, int8_select, ln_quant, quantize
from models.gemm_persistent import SWEEP
from models.sam import fused_attention


def test_a_variant_s_switches_hold_inside_and_are_put_back() -> None:
    name = "bf16-gelu-int8-lnq-static-pres-compile-triton-win-pad128-x2"
    assert name in VARIANTS
    # the switches leave the model's options alone: the same variant name for clients
    assert _variant(name) == _variant("bf16-gelu-int8-lnq-static-pres-compile-triton-win")
    before = fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED
    with runtime_knobs(name):
        assert ln_quant.PACK_PAD == 128 and gemm_persistent.SERVED == PAIRED
        assert not fused_attention.DENSE_ROWS
    with pytest.raises(RuntimeError), runtime_knobs("bf16-gelu-compile-triton-win-dense"):
        assert fused_attention.DENSE_ROWS and ln_quant.PACK_PAD == 16
        raise RuntimeError("a variant that fails still puts them back")
    assert before == (fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED)
    gluon = "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon"
    assert gluon in VARIANTS and _variant(gluon) == _variant(name)
    with runtime_knobs(gluon):
        assert gemm_persistent.GLUON and gemm_persistent.SERVED is None
    assert not gemm_persistent.GLUON
    gattn = "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn"
    assert gattn in VARIANTS and _variant(gattn) == _variant(name)
    with runtime_knobs(gattn):
        assert gemm_persistent.GLUON and fused_attention.GLUON_GLOBAL
    assert not gemm_persistent.GLUON and not fused_attention.GLUON_GLOBAL
    gwin = gattn + "-gwin"
    assert gwin in VARIANTS and _variant(gwin) == _variant(name)
    with runtime_knobs(gwin):
        assert fused_attention.GLUON_WINDOW
    assert not fused_attention.GLUON_WINDOW
    pingpong = gwin + "-pingpong"  # every Gluon GEMM in its ping-pong form
    assert pingpong in VARIANTS and _variant(pingpong) == _variant(name)
    assert gemm_gluon.COOPERATIVE
    with runtime_knobs(pingpong):
        assert not gemm_gluon.COOPERATIVE and fused_attention.GLUON_WINDOW
    assert gemm_gluon.COOPERATIVE
    kept0 = gwin + "-kept0"  # no layer left in float by the per-layer choice
    assert kept0 in VARIANTS and _variant(kept0) == _variant(name)
    served = quantize.INT8_MAX_KEPT
    with runtime_knobs(kept0):
        assert quantize.INT8_MAX_KEPT == 0.0
    assert quantize.INT8_MAX_KEPT == served > 0
    # the attention writing proj's input int8 (`-pstatic`, an option), on some blocks only
    pstatic = gwin.replace("-pres-", "-pres-pstatic-")
    assert _variant(pstatic).proj_static and not _variant(name).proj_static
    for blocks in ("windowed", "global"):
        only = f"{pstatic}-kept0-p{blocks}"
        assert only in VARIANTS and _variant(only) == _variant(pstatic)
        with runtime_knobs(only):
            assert blocks == quantize.PROJ_STATIC_BLOCKS and quantize.INT8_MAX_KEPT == 0.0
        assert quantize.PROJ_STATIC_BLOCKS == "all"
    served_room = quantize.PROJ_HEADROOM
    with runtime_knobs(f"{pstatic}-kept0-ph150"):
        assert quantize.PROJ_HEADROOM == 1.5
    assert quantize.PROJ_HEADROOM == served_room == 3.0
    leaves = f"{pstatic}-kept0-leaves"  # calibrated on dead-leaves images
    assert leaves in VARIANTS and _variant(leaves) == _variant(pstatic)
    with runtime_knobs(leaves):
        assert int8_select.SYNTHETIC == "leaves" and quantize.INT8_MAX_KEPT == 0.0
    assert int8_select.SYNTHETIC is None  # each model its own: SAM leaves
    with runtime_knobs(f"{gwin}-smooth"):  # as the rows before 2026-12-07 ran
        assert int8_select.SYNTHETIC == "smooth"
    assert int8_select.SYNTHETIC is None
    with runtime_knobs("bf16-gelu-int8-lnq-static-pres-compile-triton-win-ln2x2"):
        assert ln_quant.SHAPE == (2, 2) and ln_quant.launch_shape(1024) == (2, 2)
        assert not fused_attention.DENSE_ROWS
    assert ln_quant.SHAPE is None
    assert ln_quant.launch_shape(1024) == (4, 4)  # the served shape
    assert PAIRED in SWEEP  # a shape the products' sweep times too


WIDTHS_SCRIPT = r"""
import torch
from torch import nn
from bench.sam_encoder import runtime_knobs
from models import ln_quant

x = torch.randn(6, 32)
base = "bf16-gelu-int8-lnq-static-pres-compile-triton-win"
for name in (base, base + "-pad128"):
    torch._dynamo.reset()
    with runtime_knobs(name):
        norm = ln_quant.QuantizingLayerNorm(nn.LayerNorm(32), fp8=False)
        print(torch.compile(norm)(x).shape[-1])
"""


def test_a_padded_variant_compiles_its_own_width_not_the_cached_one(tmp_path: Path) -> None:
    """Inductor's cache keys the graph, not the norm's fake output width: without the
    knobs turning every cache off, the second compile loads the first's size asserts (seen
    on the H200 as `stride 896==784`). In a process where the environment forced the
    caches on before inductor was imported (as the engine's build may: this test once
    failed after an engine's in one pytest worker), inductor's own switches cannot turn
    them off; `force_disable_caches` can. A process of its own, so the environment is
    read at import as it was then."""
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", WIDTHS_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["48", "160"]  # 32 values, then 16 or 128 bytes


def test_calphotos_variants_calibrate_on_the_photos(monkeypatch: pytest.MonkeyPatch) -> None:
    """`-calphotos`: the encoder calibrated on `CALIBRATION` (the photos mirrored, as
    SERVE_CALIBRATION_IMAGES would give), not on synthetic images: other fixed scales."""
    import torch

    from bench import sam_encoder
    from models.fidelity import load_photos
    from models.quant_linear import DynamicQuantLinear
    from models.sam import SAM_CONFIGS, load_sam
    from models.sam import transforms as tf

    base = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).eval()
    photos = load_photos(Path(__file__).resolve().parents[1] / "photos")  # the repo's own
    mirrored, _ = tf.preprocess_images([ph.flip(1) for ph in photos[:2]], base.config, "cpu")
    monkeypatch.setattr(sam_encoder, "CALIBRATION", mirrored)
    monkeypatch.setattr(sam_encoder, "DEVICE", "cpu")
    served = "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0"
    scales = []
    for name in (served, served + "-calphotos"):
        assert name in VARIANTS and _variant(name) == _variant(served)
        _, model = sam_encoder.prepared(name, base)
        projs = [(n, m) for n, m in model.named_modules() if n.endswith("attn.proj")]
        scales.append({n: m.input_inv_scale for n, m in projs
                       if isinstance(m, DynamicQuantLinear)})  # fmt: skip
    assert scales[0].keys() == scales[1].keys() and scales[0]
    assert all(not torch.equal(scales[0][n], scales[1][n]) for n in scales[0])
    monkeypatch.setattr(sam_encoder, "CALIBRATION", None)  # no photos: refused, not synthetic
    with pytest.raises(RuntimeError, match="no photos"):
        sam_encoder.prepared(served + "-calphotos", base)
