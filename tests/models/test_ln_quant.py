"""The LayerNorm that writes its output quantised (models.ln_quant): the Triton kernel in the
interpreter against its torch reference, the packed rows read in place by the fused GEMM,
and the norms swapped in Swin's and SAM's encoder blocks (same output, one graph)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import ln_quant
from models.fp8_gemm import FP8, quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import quantize_rows
from models.ln_quant import (
    PACK_PAD,
    QuantizingLayerNorm,
    layer_norm_quant,
    pack_rows,
    packed_linear,
    unpack_rows,
)
from models.optimize import OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.quantize import DynamicQuantLinear
from models.sam import Sam
from models.swin import SwinConfig, SwinTransformer
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import torch
from models.int8_gemm import GemmConfig, int8_linear_reference, launch
from models.fp8_gemm import fp8_linear_reference, quantize_weight_fp8
from models.ln_quant import launch_layer_norm_quant, layer_norm_quant_reference, unpack_rows

results = []
for seed, (M, C, N, dtype, fp8) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 3 + torch.randn(M, 1, generator=g)
    x = x.to(getattr(torch, dtype))
    x[0, 5] = 40.0  # an outlier sets row 0's scale
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g) / 4
    got = launch_layer_norm_quant(x, w, b, 1e-5, fp8)
    want = layer_norm_quant_reference(x, w, b, 1e-5, fp8)
    q, s = unpack_rows(got, fp8)
    rq, rs = unpack_rows(want, fp8)
    if fp8:
        step = (q.float() - rq.float()).abs() / rq.float().abs().clamp(min=2**-6)
        off = float(step.max())
        mismatch = float((q.float() != rq.float()).float().mean())
    else:
        off = float((q.int() - rq.int()).abs().max())
        mismatch = float((q != rq).float().mean())
    # the GEMM reading the packed rows in place (strided values and scales)
    wf = torch.randn(N, C, generator=g) / C**0.5
    bias = b[:N] if N <= C else None
    if fp8:
        wq, ws = quantize_weight_fp8(wf)
        reference = fp8_linear_reference
    else:
        ws = wf.abs().amax(1) / 127
        wq = torch.round(wf / ws[:, None]).to(torch.int8)
        reference = int8_linear_reference
    ref = reference(q.contiguous(), s.contiguous(), wq, ws, bias, None, False, torch.float32)
    out = launch(q, s, wq, ws, bias, None, out_dtype=torch.float32,
                 config=GemmConfig(32, 32, 32, 2, 4))
    results.append({"shape": list(got.shape), "dtype": str(got.dtype),
                    "scale_rel": float(((s - rs).abs() / rs).max()), "off": off,
                    "mismatch": mismatch, "gemm_abs": float((out - ref).abs().max()),
                    "gemm_scale": float(ref.abs().max()),
                    "q_strided": q.stride(0) == C + 16, "s_strided": s.stride(0) == (C + 16) // 4})
print(json.dumps(results))
"""

CASES = [
    # M, C, N (the GEMM after), activation dtype, fp8
    (37, 96, 64, "float32", False),  # C not a power of two, M not a multiple of the rows
    (20, 96, 48, "bfloat16", True),
    (9, 768, 32, "bfloat16", False),  # ViT-B's width
    (16, 384, 96, "float32", True),
]


def test_kernel_matches_the_reference_and_the_gemm_reads_its_rows_in_place() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for r, (M, C, _, _, fp8) in zip(results, CASES, strict=True):
        assert r["shape"] == [M, C + PACK_PAD] and r["dtype"] == "torch.int8", r
        assert r["q_strided"] and r["s_strided"], r  # views into the packed rows, no copy
        assert r["scale_rel"] < 1e-5, r  # the same norm, summed in another order
        # a value on a rounding boundary may land one step away, rarely
        assert r["off"] <= (2**-3 if fp8 else 1) and r["mismatch"] < 0.01, r
        assert r["gemm_abs"] <= 1e-5 * r["gemm_scale"], r


def test_packed_rows_round_trip_and_a_zero_row_gives_the_bias() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    x[3] = 0.0  # SAM's window padding: zeros after the norm
    for fp8 in (False, True):
        q, s = quantize_rows_fp8(x) if fp8 else quantize_rows(x)
        packed = pack_rows(q, s)
        assert packed.shape == (5, 32 + PACK_PAD) and packed.dtype == torch.int8
        uq, us = unpack_rows(packed, fp8)
        assert uq.dtype == (FP8 if fp8 else torch.int8)
        assert torch.equal(uq.view(torch.int8), q.view(torch.int8)) and torch.equal(us, s)
        zero = torch.zeros_like(packed[:1])  # F.pad's rows: values and scale all 0
        if fp8:
            wq, ws = quantize_weight_fp8(torch.randn(16, 32, generator=g))
        else:
            wq = torch.randint(-127, 128, (16, 32), dtype=torch.int8, generator=g)
            ws = torch.rand(16, generator=g)
        bias = torch.randn(16, generator=g)
        y = packed_linear(zero, wq, ws, bias, None, False, torch.float32)
        assert torch.equal(y[0], bias)


def test_the_ops_have_shapes_for_the_compiler() -> None:
    x, w, b = torch.randn(7, 48), torch.ones(48), torch.zeros(48)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))
        packed = layer_norm_quant(fx, fw, fb, 1e-6, False)
        assert packed.shape == (7, 48 + PACK_PAD) and packed.dtype == torch.int8
        wq = mode.from_tensor(torch.zeros(32, 48, dtype=torch.int8))
        y = packed_linear(packed, wq, mode.from_tensor(torch.ones(32)), None, None, True,
                          torch.bfloat16)  # fmt: skip
        assert y.shape == (7, 32) and y.dtype == torch.bfloat16


TINY = SwinConfig(
    name="swin_test", embed_dim=32, depths=(2, 2), num_heads=(2, 4), img_size=64,
    window_size=4, num_classes=10,
)  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_swin_blocks_take_their_input_quantised_by_the_norm(kind: str) -> None:
    """norm1 -> (roll, windows) -> qkv and norm2 -> fc1 carry packed rows: the result is
    the unfused quantised model's (fp32: the norm is the same arithmetic), eager and
    compiled in one graph; a norm whose Linear stayed in float stays a LayerNorm."""
    torch.manual_seed(0)
    base = SwinTransformer(TINY).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    prepare_swin(plain, OptimizeOptions(quantization=kind))  # type: ignore[arg-type]
    prepare_swin(fused, OptimizeOptions(quantization=kind, norm_quant=True))  # type: ignore[arg-type]
    blocks = [b for stage in fused.layers for b in stage.blocks]
    swapped = 0
    for block in blocks:
        for norm, linear in ((block.norm1, block.attn.qkv), (block.norm2, block.mlp.fc1)):
            quantised = isinstance(linear, DynamicQuantLinear)
            assert isinstance(norm, QuantizingLayerNorm) == quantised
            assert isinstance(norm, nn.LayerNorm) != quantised
            swapped += quantised
    assert swapped >= 6
    # same parameters under the same names: a checkpoint loads into either
    assert fused.state_dict().keys() == plain.state_dict().keys()
    with torch.inference_mode():
        want, got = plain(x), fused(x)
        assert torch.equal(got, want)
        compiled = torch.compile(fused, fullgraph=True, dynamic=False)(x)
    assert float((compiled - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("pad", [16, 128])
def test_sam_encoder_blocks_take_their_input_quantised_through_window_padding(
    tiny_sam: Sam, pad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SAM's windowed block pads the normed grid (16 -> 18 for windows of 6): padded packed
    rows are zeros, whose scale 0 gives the bias, as a zero float row does. Rows 128 bytes
    longer (bench/sam_encoder.py's `-pad128` variants, rows TMA's boxes find aligned) change
    nothing either."""
    monkeypatch.setattr(ln_quant, "PACK_PAD", pad)
    images = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(2))
    outputs = []
    for norm_quant in (False, True):
        model = copy.deepcopy(tiny_sam)
        options = OptimizeOptions(quantization="int8", norm_quant=norm_quant)
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"))
        norms = [m for m in model.image_encoder.modules() if isinstance(m, QuantizingLayerNorm)]
        assert bool(norms) == norm_quant
        with torch.inference_mode():
            outputs.append(model.encode(images))
    assert torch.equal(outputs[0], outputs[1])


def test_kernel_compiles_for_hopper() -> None:
    """Compiled (not run) for an H100, for Swin's narrowest and ViT-B's width, both kinds:
    e4m3's values leave through the hardware's conversion (`cvt ... e4m3x2`)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.ln_quant import _kernel

    pointers = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "P": "*i8"}
    signature = {**pointers, "M": "i32", "C": "i32", "stride_x": "i32", "stride_p": "i32",
                 "eps": "fp32"}  # fmt: skip
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*pointers, "stride_p"]}
    for fp8 in (False, True):
        for block_c, rows in ((128, 16), (1024, 4)):
            constexprs = {"IS_FP8": fp8, "BLOCK_C": block_c, "ROWS": rows}
            source = ASTSource(_kernel(), {**signature, **dict.fromkeys(constexprs, "constexpr")},
                               constexprs, attrs)  # fmt: skip
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4}).asm["ptx"]  # fmt: skip
            assert bool(re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == fp8
            # the rounding by 1.5 * 2^23 (add, then subtract) is not folded away
            assert "0f4B400000" in ptx


def test_rows_not_laid_out_one_after_another_are_copied_first() -> None:
    """A packed tensor as a view at an odd offset or with a row gap still unpacks to the
    same values and scales (through a fresh aligned copy)."""
    q, s = quantize_rows(torch.randn(6, 32, generator=torch.Generator().manual_seed(4)))
    packed = pack_rows(q, s)
    wide = torch.zeros(7, 2 * (32 + PACK_PAD), dtype=torch.int8)
    wide[1:, 3 : 3 + 32 + PACK_PAD] = packed
    for view in (wide[1:, 3 : 3 + 32 + PACK_PAD], packed[::1]):
        uq, us = unpack_rows(view, fp8=False)
        assert torch.equal(uq, q) and torch.equal(us, s)


SHAPES_SCRIPT = r"""
import json, sys
import torch
from models import ln_quant

results = []
for seed, (M, C, rows, warps) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 2 + 0.5
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g) / 4
    ln_quant.SHAPE = (rows, warps)
    got = ln_quant.launch_layer_norm_quant(x, w, b, 1e-5, False)
    want = ln_quant.layer_norm_quant_reference(x, w, b, 1e-5, False)
    q, s = ln_quant.unpack_rows(got, False)
    rq, rs = ln_quant.unpack_rows(want, False)
    results.append({"off": int((q.int() - rq.int()).abs().max()),
                    "scale_rel": float(((s - rs).abs() / rs).max())})
print(json.dumps(results))
"""


def test_every_launch_shape_of_the_sweep_writes_the_same_rows() -> None:
    """bench/ln_quant_sweep.py times `ln_quant.SHAPE`s against each other: each must be the
    same norm, whatever rows a program holds (M not a multiple of them)."""
    cases = [(37, 96, 1, 1), (37, 96, 2, 1), (37, 96, 4, 2), (37, 96, 16, 8)]
    for r in run_interpreted(SHAPES_SCRIPT, cases):
        assert r["off"] <= 1 and r["scale_rel"] < 1e-5, r
