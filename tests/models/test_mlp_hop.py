"""The MLP's hidden activation handed from fc1 to fc2 quantised in groups of 128 columns
(models.mlp_hop): the kernel's quantised epilogue and group-scaled loop in Triton's
interpreter against the torch references, compiled for an H100, and in Swin and SAM."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.fp8_gemm import quantize_weight_fp8
from models.int8_gemm import HOP_GROUP, quantize_rows
from models.mlp_hop import (
    linear_from_groups,
    linear_from_groups_reference,
    linear_to_groups,
    quantize_groups,
)
from models.optimize import OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.quantize import DynamicQuantLinear, quantize_linears
from models.sam import Sam
from models.swin import SwinConfig, SwinTransformer
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import torch
from models.fp8_gemm import quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import launch, launch_quant_out, quantize_rows
from models.mlp_hop import linear_from_groups_reference, linear_to_groups_reference

results = []
for seed, (M, C, H, fp8) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g)
    w1, b1 = torch.randn(H, C, generator=g) / C**0.5, torch.randn(H, generator=g) / 4
    w2, b2 = torch.randn(C, H, generator=g) / H**0.5, torch.randn(C, generator=g) / 4
    if fp8:
        (xq, xs), (q1, s1), (q2, s2) = (quantize_rows_fp8(x), quantize_weight_fp8(w1),
                                        quantize_weight_fp8(w2))
    else:
        xq, xs = quantize_rows(x)
        q1, q2 = (torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
                  for w in (w1, w2))
        s1, s2 = w1.abs().amax(1) / 127, w2.abs().amax(1) / 127
    hq, hs = launch_quant_out(xq, xs, q1, s1, b1, gelu=True)
    rq, rs = linear_to_groups_reference(xq, xs, q1, s1, b1, True)
    same = hq.view(torch.int8) == rq.view(torch.int8)
    out = launch(hq, hs, q2, s2, b2, None, out_dtype=torch.float32, group_k=128)
    ref = linear_from_groups_reference(hq, hs, q2, s2, b2, None, torch.float32)
    y = torch.nn.functional.gelu(x @ w1.t() + b1) @ w2.t() + b2
    results.append({"hidden": [list(hq.shape), str(hq.dtype), list(hs.shape)],
                    "scale_rel": float(((hs - rs).abs() / rs).max()),
                    "mismatch": float(1 - same.float().mean()),
                    "out_abs": float((out - ref).abs().max()), "out_scale": float(ref.abs().max()),
                    "rel_float": float((out - y).norm() / y.norm())})
print(json.dumps(results))
"""

CASES = [(40, 96, 384, False), (33, 64, 256, True), (70, 128, 512, False)]  # M, C, hidden, fp8


def test_the_hop_matches_its_references_in_the_interpreter() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for r, (M, _, H, fp8) in zip(results, CASES, strict=True):
        dtype = "torch.float8_e4m3fn" if fp8 else "torch.int8"
        assert r["hidden"] == [[M, H], dtype, [M, H // HOP_GROUP]], r
        assert r["scale_rel"] < 1e-5 and r["mismatch"] < 0.01, r  # a rare rounding boundary
        assert r["out_abs"] <= 1e-5 * r["out_scale"], r
        assert 0 < r["rel_float"] < (0.06 if fp8 else 0.02), r


def test_groups_scale_each_128_columns_and_the_ops_trace() -> None:
    y = torch.randn(3, 256)
    y[0, 5] = 50.0  # an outlier spoils its own group only
    q, s = quantize_groups(y, fp8=False)
    assert q.shape == (3, 256) and s.shape == (3, 2)
    torch.testing.assert_close(s[:, 1], y[:, 128:].abs().amax(1) / 127)
    assert s[0, 0] == 50.0 / 127 and s[0, 1] < 5 / 127
    wq, ws = quantize_weight_fp8(torch.randn(64, 256))
    qf, sf = quantize_groups(y, fp8=True)
    out = linear_from_groups(qf, sf, wq, ws, None, None, torch.float32)
    torch.testing.assert_close(out, linear_from_groups_reference(qf, sf, wq, ws, None, None,
                                                                 torch.float32))  # fmt: skip
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        xq, xs = (mode.from_tensor(t) for t in quantize_rows(torch.randn(5, 64)))
        w = mode.from_tensor(torch.zeros(256, 64, dtype=torch.int8))
        hq, hs = linear_to_groups(xq, xs, w, mode.from_tensor(torch.ones(256)), None, True)
        assert hq.shape == (5, 256) and hq.dtype == torch.int8 and hs.shape == (5, 2)


def test_the_hop_compiles_for_hopper() -> None:
    """Compiled (not run) for an H100: fc1's tiles (HOP_CONFIGS, 128 wide) quantising their
    output, and fc2's group-scaled loop over every candidate, both kinds, stay warpgroup
    MMAs within shared memory."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.gemm_kernel import HOP_CONFIGS, HOPPER_CONFIGS, _kernel

    ints = ["M", "N", "K", "M_BUCKET", "stride_am", "stride_bn", "stride_rm", "stride_cm",
            "stride_xs", "stride_os"]  # fmt: skip
    for fp8 in (False, True):
        operand = "*fp8e4nv" if fp8 else "*i8"
        for quant_out, configs in ((True, HOP_CONFIGS), (False, HOPPER_CONFIGS)):
            pointers = {"A": operand, "B": operand, "XS": "*fp32", "WS": "*fp32",
                        "BIAS": "*bf16", "RES": "*bf16", "C": "*i8" if quant_out else "*bf16",
                        "OS": "*fp32"}  # fmt: skip
            signature = {**pointers, **dict.fromkeys(ints, "i32")}
            names = list(signature)
            aligned = [*pointers, "N", "K", "stride_am", "stride_bn", "stride_cm"]
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            for c in configs:
                constexprs = {"HAS_BIAS": True, "HAS_RES": False, "GELU": quant_out,
                              "IS_FP8": fp8, "GROUP_K": 0 if quant_out else 128,
                              "QUANT_OUT": quant_out, "BLOCK_M": c.block_m,
                              "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": 8}  # fmt: skip
                source = ASTSource(_kernel(), {**signature, **dict.fromkeys(constexprs,
                                   "constexpr")}, constexprs, attrs)  # fmt: skip
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                          options={"num_warps": c.num_warps,
                                                   "num_stages": c.num_stages})  # fmt: skip
                mma = set(re.findall(r"wgmma\.mma_async\.[\w.]+", compiled.asm["ptx"]))
                assert mma, (fp8, quant_out, c)
                assert compiled.metadata.shared <= 227 * 1024, (fp8, quant_out, c)


TINY = SwinConfig(
    name="swin_test", embed_dim=32, depths=(2, 2), num_heads=(2, 4), img_size=64,
    window_size=4, num_classes=10,
)  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_swin_mlps_hand_their_hidden_activation_quantised(kind: str) -> None:
    torch.manual_seed(0)
    base = SwinTransformer(TINY).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    plain, hop = copy.deepcopy(base), copy.deepcopy(base)
    options = OptimizeOptions(quantization=kind, norm_quant=True)  # type: ignore[arg-type]
    prepare_swin(plain, options)
    prepare_swin(hop, OptimizeOptions(quantization=kind, norm_quant=True, mlp_hop=True))  # type: ignore[arg-type]
    mlps = [b.mlp for stage in hop.layers for b in stage.blocks]
    for mlp in mlps:  # wherever both Linears are quantised
        both = isinstance(mlp.fc1, DynamicQuantLinear) and isinstance(mlp.fc2, DynamicQuantLinear)
        assert getattr(mlp.fc1, "hop_out", False) == both
    assert sum(m.fc1.hop_out for m in mlps if isinstance(m.fc1, DynamicQuantLinear)) >= 3
    with torch.inference_mode():
        want, got, plain_out = base(x), hop(x), plain(x)
        compiled = torch.compile(hop, fullgraph=True, dynamic=False)(x)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    # groups of 128 round no worse than rows: the same error as without the hop, about
    assert 0 < rel(got, want) < 1.5 * rel(plain_out, want)
    assert rel(compiled, got) < 1e-3


def test_sam_encoder_mlps_hand_their_hidden_activation_quantised(tiny_sam: Sam) -> None:
    images = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(2))
    outputs = []
    for hop in (False, True):
        model = copy.deepcopy(tiny_sam)
        options = OptimizeOptions(quantization="int8", norm_quant=True, mlp_hop=hop)
        prepare_sam_encoder(model.image_encoder, options, torch.device("cpu"))
        firsts = [b.mlp.lin1 for b in model.image_encoder.blocks]
        assert any(getattr(m, "hop_out", False) for m in firsts) == hop
        assert all(isinstance(b.mlp.act, nn.Identity) for b in model.image_encoder.blocks
                   if isinstance(b.mlp.lin1, DynamicQuantLinear))  # fmt: skip
        with torch.inference_mode():
            outputs.append(model.encode(images))
    with torch.inference_mode():
        want = tiny_sam.encode(images)
    errors = [float((o - want).norm() / want.norm()) for o in outputs]
    assert 0 < errors[1] < 1.5 * errors[0] and errors[1] < 0.05, errors


def test_the_per_layer_choice_measures_a_hop_input_in_groups() -> None:
    """With the hop, fc2 sees its input quantised per 128 columns: the per-layer choice
    measures it so (`grouped`). An outlier in one group then costs the others nothing, and
    the measured error drops well below the per-row one."""
    from models.int8_select import measure_int8
    from models.mlp_hop import mlp_second_layers

    torch.manual_seed(0)
    model = SwinTransformer(TINY).eval()
    assert mlp_second_layers(model) == {
        f"layers.{s}.blocks.{b}.mlp.fc2" for s in range(2) for b in range(2)
    }
    layer = nn.Linear(512, 32)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 40  # an outlier channel in the first of 4 groups

    def everything(name: str, module: nn.Linear) -> bool:
        return True

    for kind in ("int8", "fp8"):
        rows = measure_int8(layer, lambda: layer(x), everything, kind=kind).errors[""]
        groups = measure_int8(layer, lambda: layer(x), everything, kind=kind,
                              grouped=frozenset({""})).errors[""]  # fmt: skip
        assert 0 < groups < (0.7 if kind == "int8" else 1.0) * rows, (kind, groups, rows)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_blocks_residual_is_added_in_the_mlps_last_epilogue(kind: str) -> None:
    """Swin's and SAM's blocks hand `x` to their MLP as the residual: a quantised second
    Linear adds it in its epilogue (the same fp32 sum, rounded once), with or without the
    hop; a float one after it, exactly as `x + mlp(norm2(x))` did."""
    from models.sam.common import MLPBlock
    from models.swin.model import Mlp

    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 7, 64, generator=g), torch.randn(3, 7, 64, generator=g)
    for cls in (Mlp, MLPBlock):
        torch.manual_seed(1)
        mlp = cls(64, 256).eval()
        with torch.inference_mode():
            assert torch.equal(mlp(x, residual=r), r + mlp(x))  # float: as before
        for hop in (False, True):
            quantised = copy.deepcopy(mlp)
            quantize_linears(quantised, kind, lambda name, layer: True, mlp_hop=hop)  # type: ignore[arg-type]
            assert isinstance(quantised.act, nn.Identity)  # GELU in the first epilogue
            with torch.inference_mode():
                fused, alone = quantised(x, residual=r), quantised(x)
            assert fused.shape == r.shape
            torch.testing.assert_close(fused, alone + r, rtol=1e-6, atol=1e-6)
