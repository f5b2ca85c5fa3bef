"""The fused fp8 (e4m3) GEMM (models.fp8_gemm): the shared Triton kernel in its fp8 form
against the torch reference and the float product, its custom op, and the fp8 layers.

As for int8 (tests/models/test_int8_gemm.py), the kernel runs in Triton's interpreter (a
subprocess with `TRITON_INTERPRET=1`), where e4m3 operands are widened exactly and dotted in
fp32; and it is compiled, not run, for an H100 to check it becomes fp8 warpgroup MMAs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from models.fp8_gemm import (
    FP8,
    FP8_MAX,
    fp8_linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rows_fp8,
    quantize_weight_fp8,
)
from models.optimize import OptimizeOptions, prepare_swin
from models.quantize import Fp8DynamicLinear, Int8DynamicLinear
from models.swin import SwinConfig, SwinTransformer
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import torch
from models.fp8_gemm import quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import GemmConfig, epilogue_reference, launch

def e4m3(q):  # the bytes decoded by e4m3's definition, not by this CPU's conversion
    codes = torch.arange(256)
    sign = torch.where(codes >= 128, -1.0, 1.0).double()
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).double()
    value = torch.where(exponent == 0, mantissa / 8 * 2.0**-6,
                        (1 + mantissa / 8) * 2.0 ** (exponent - 7).double())
    return (sign * value)[q.view(torch.uint8).long()]

results = []
for seed, case in enumerate(json.loads(sys.argv[1])):
    M, K, N, bias, gelu, residual, dtype, cfg = case
    g = torch.Generator().manual_seed(seed)
    out_dtype = getattr(torch, dtype)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(M, N + 8, generator=g).to(out_dtype)[:, :N] if residual else None
    xq, xs = quantize_rows_fp8(x)
    wq, ws = quantize_weight_fp8(w)
    out = launch(xq, xs, wq, ws, b, r, gelu=gelu, out_dtype=out_dtype,
                 config=GemmConfig(*cfg) if cfg else None)
    # the exact product (float64 holds every sum of 96-384 e4m3 products exactly), so the
    # bound does not depend on how this CPU's BLAS orders or widens an fp32 matmul
    xd, wd = e4m3(xq), e4m3(wq)
    exact = epilogue_reference(xd @ wd.t(), xs, ws, b, r, gelu, torch.float64)
    # fp32 summation in any order: at most K ulps of the sum of the products' magnitudes
    # (GELU's slope is below 1.13), then a few ulps for the epilogue's own roundings
    magnitude = (xd.abs() @ wd.abs().t()) * xs.double()[:, None] * ws.double()
    tol = K * 2**-23 * 1.13 * magnitude + 2**-20 * (exact.abs() + 1)
    if out_dtype != torch.float32:
        tol = tol + 2**-7 * exact.abs()  # one bf16 rounding: within an ulp, either way
    y = x @ w.t() + (b if b is not None else 0)
    y = torch.nn.functional.gelu(y) if gelu else y
    y = y + (r.float() if r is not None else 0)
    error = (out.double() - exact).abs()
    results.append({"shape": list(out.shape), "dtype": str(out.dtype),
                    "max_abs": float(error.max()), "excess": float((error / tol).max()),
                    # reported, not asserted: whether torch's own widening agrees here
                    "torch_widens_alike": torch.equal(xd, xq.double())
                    and torch.equal(wd, wq.double()),
                    "rel_float": float((out.double() - y.double()).norm() / y.double().norm())})
print(json.dumps(results))
"""

CASES = [
    # M, K, N, bias, GELU, residual, out dtype, (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (200, 96, 288, True, False, False, "float32", (64, 32, 32, 2, 4)),  # Swin stage 1 qkv
    (77, 96, 288, True, True, True, "float32", (32, 64, 64, 2, 4)),  # K % BLOCK_K != 0
    (33, 96, 384, True, True, False, "bfloat16", (64, 128, 32, 2, 4)),  # fc1 + GELU, bf16
    (50, 384, 96, False, False, True, "bfloat16", (32, 32, 128, 2, 4)),  # fc2 + residual
    (65, 96, 288, True, False, True, "bfloat16", None),  # through the autotuner
]


def test_fp8_kernel_matches_the_reference_and_the_float_product_in_the_interpreter() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for r, case in zip(results, CASES, strict=True):
        M, _, N, _, _, _, dtype, _ = case
        assert r["shape"] == [M, N] and r["dtype"] == f"torch.{dtype}", r
        # within fp32 summation's bound of the exact product (and one bf16 rounding)
        assert r["excess"] <= 1, r
        # e4m3 keeps 3 mantissa bits: a few percent from the float product, never more
        assert 0 < r["rel_float"] < 0.04, r


def test_quantize_rows_fp8_maps_each_rows_absmax_to_448() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3000.0, 1.0, -3.0]])
    q, s = quantize_rows_fp8(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3,)
    assert q[0].float().tolist() == [224.0, -448.0, 112.0]
    assert q[1].float().tolist() == [0.0, 0.0, 0.0]
    assert q[2].float().abs().max() == FP8_MAX and not q.float().isnan().any()
    torch.testing.assert_close(s, torch.tensor([2.0, 1e-12, 3000.0]) / 448)
    w, ws = quantize_weight_fp8(torch.randn(48, 32))
    assert w.is_contiguous() and w.shape == (48, 32) and ws.shape == (48,)


def test_the_fp8_op_compiles_in_one_graph_and_gives_the_eager_result() -> None:
    assert not fp8_supported(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    wq, ws = quantize_weight_fp8(torch.randn(48, 64, generator=g) / 8)
    bias, residual = torch.randn(48, generator=g), torch.randn(45, 48, generator=g)

    def fn(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows_fp8(x)
        return fp8_linear(q, s, wq, ws, bias, r, True, torch.bfloat16) * 2

    x = torch.randn(45, 64, generator=g)
    eager = fn(x, residual)
    assert eager.shape == (45, 48) and eager.dtype == torch.bfloat16
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, residual), eager, rtol=0, atol=0)
    q, s = quantize_rows_fp8(x)
    want = fp8_linear_reference(q, s, wq, ws, bias, residual, True, torch.bfloat16) * 2
    assert torch.equal(eager, want)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = fp8_linear(*(mode.from_tensor(t) for t in (q, s, wq, ws)),
                          None, None, False, torch.float16)  # fmt: skip
    assert fake.shape == (45, 48) and fake.dtype == torch.float16


def test_fp8_kernel_compiles_for_hopper_to_fp8_wgmma() -> None:
    """Compiled (not run) for an H100 as the GPU will specialise it: every autotune
    candidate must become e4m3 warpgroup MMAs accumulating in fp32, fit in shared memory,
    and store its bf16 output in 16-byte vectors."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.gemm_kernel import HOPPER_CONFIGS, _kernel

    pointers = {"A": "*fp8e4nv", "B": "*fp8e4nv", "XS": "*fp32", "WS": "*fp32",
                "BIAS": "*bf16", "RES": "*bf16", "C": "*bf16", "OS": "*fp32"}  # fmt: skip
    ints = ["M", "N", "K", "M_BUCKET", "stride_am", "stride_bn", "stride_rm", "stride_cm",
            "stride_xs", "stride_os"]  # fmt: skip
    signature = {**pointers, **dict.fromkeys(ints, "i32")}
    names = list(signature)
    aligned = [*pointers, "N", "K", "stride_am", "stride_bn", "stride_rm", "stride_cm"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    for c in HOPPER_CONFIGS:
        constexprs = {"HAS_BIAS": True, "HAS_RES": True, "GELU": False, "IS_FP8": True,
                      "GROUP_K": 0, "QUANT_OUT": False,
                      "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                      "GROUP_M": 8}  # fmt: skip
        source = ASTSource(_kernel(), {**signature, **dict.fromkeys(constexprs, "constexpr")},
                           constexprs, attrs)  # fmt: skip
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": c.num_warps, "num_stages": c.num_stages},
        )
        ptx = compiled.asm["ptx"]
        mma = set(re.findall(r"wgmma\.mma_async\.[\w.]+", ptx))
        assert mma and all(m.endswith(".f32.e4m3.e4m3") for m in mma), (c, mma)
        assert compiled.metadata.shared <= 227 * 1024, (c, compiled.metadata.shared)
        assert set(re.findall(r"st\.global\.[\w.]+", ptx)) == {"st.global.v4.b32"}, c


TINY = SwinConfig(
    name="swin_test", embed_dim=32, depths=(2, 2), num_heads=(2, 4), img_size=64,
    window_size=4, num_classes=10,
)  # fmt: skip


def test_swin_fp8_through_the_fused_layers_with_the_per_layer_choice() -> None:
    """SERVE_QUANTIZATION=fp8 (core): `Fp8DynamicLinear` layers, measured with fp8's own
    error and kept in float past FP8_MAX_ERROR (at most 1/8), GELU in fc1's epilogue, bias
    corrected; close to the float model, and further from it than int8."""
    torch.manual_seed(0)
    base = SwinTransformer(TINY).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = base(x)
    errors = {}
    for kind in ("int8", "fp8"):
        model = copy.deepcopy(base)
        prepare_swin(model, OptimizeOptions(quantization=kind))
        quantised = (Int8DynamicLinear, Fp8DynamicLinear)
        layers = [m for m in model.modules() if isinstance(m, quantised)]
        assert {m.kind for m in layers} == {kind} and 14 <= len(layers) <= 16
        for block in (b for stage in model.layers for b in stage.blocks):
            if isinstance(block.mlp.fc1, quantised):
                assert block.mlp.fc1.gelu and isinstance(block.mlp.act, nn.Identity)
        with torch.inference_mode():
            got = model(x)
        errors[kind] = float((got.double() - want.double()).norm() / want.double().norm())
    assert 0 < errors["int8"] < errors["fp8"] < 0.06, errors
