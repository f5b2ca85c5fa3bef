"""The fused int8 GEMM (models.int8_gemm) against its torch reference, and its custom op.

CI has no GPU, so the Triton kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`,
read when Triton is imported, hence a subprocess): the same kernel source executed with
numpy, int8 dots and int32 accumulation included. It checks the arithmetic and the
indexing (M not a multiple of the tile, K not a multiple of BLOCK_K, Swin's K = 96 into
N = 288, bias, GELU, residual, strided operands, bf16 output); speed is measured on the GPU
by bench/int8_gemm.py. The op itself (what model code calls) runs its torch reference on
the CPU: checked eagerly and under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import torch

from models.int8_gemm import (
    fused_supported,
    int8_linear,
    int8_linear_reference,
    quantize_rows,
)
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import torch
from models.int8_gemm import GemmConfig, int8_linear_reference, launch, quantize_rows

results = []
for seed, case in enumerate(json.loads(sys.argv[1])):
    M, K, N, bias, gelu, residual, dtype, cfg = case
    g = torch.Generator().manual_seed(seed)
    out_dtype = getattr(torch, dtype)
    x = torch.randn(M, K, generator=g)
    xq, xs = quantize_rows(x)
    if seed % 2:  # a column-major activation, as a compiled graph may hand one over
        xq = xq.t().contiguous().t()
    w = torch.randn(N, K, generator=g) / K**0.5
    ws = w.abs().amax(1) / 127
    wq = torch.round(w / ws[:, None]).to(torch.int8)
    b = torch.randn(N, generator=g) if bias else None
    # the residual as a strided view (rows of a wider tensor), in the output dtype
    r = torch.randn(M, N + 8, generator=g).to(out_dtype)[:, :N] if residual else None
    out = launch(xq, xs, wq, ws, b, r, gelu=gelu, out_dtype=out_dtype,
                 config=GemmConfig(*cfg) if cfg else None)
    ref = int8_linear_reference(xq, xs, wq, ws, b, r, gelu, out_dtype)
    diff = (out.float() - ref.float()).abs().max()
    results.append({"case": case, "dtype": str(out.dtype), "shape": list(out.shape),
                    "max_abs": float(diff), "equal": bool(torch.equal(out, ref)),
                    "scale": float(ref.float().abs().max())})
print(json.dumps(results))
"""

CASES = [
    # M, K, N, bias, GELU, residual, out dtype, (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (200, 96, 288, True, False, False, "float32", (64, 32, 32, 2, 4)),  # Swin stage 1 qkv
    (77, 96, 288, True, True, True, "float32", (32, 64, 64, 2, 4)),  # K % BLOCK_K != 0
    (130, 64, 48, False, False, True, "float32", (64, 64, 32, 2, 4)),  # N < BLOCK_N
    (33, 96, 384, True, True, False, "bfloat16", (64, 128, 32, 2, 4)),  # fc1 + GELU, bf16
    (50, 384, 96, True, False, True, "bfloat16", (32, 32, 128, 2, 4)),  # fc2 + residual
    (16, 32, 16, True, False, False, "float16", (16, 16, 16, 1, 1)),  # the smallest tile
    # no config: through the autotuner (its pruning and key; one candidate, K-masked loads)
    (90, 80, 48, True, True, False, "float32", None),  # K = 80: 32 does not divide it
    (65, 96, 288, True, False, True, "bfloat16", None),
]


def test_kernel_matches_the_torch_reference_in_the_interpreter() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for r, case in zip(results, CASES, strict=True):
        M, _, N, _, gelu, _, dtype, _ = case
        assert r["shape"] == [M, N] and r["dtype"] == f"torch.{dtype}", r
        if not gelu and dtype == "float32":
            # the same fp32 operations in the same order: bit for bit
            assert r["equal"], r
        elif dtype == "float32":
            assert r["max_abs"] < 1e-5 * r["scale"], r  # erf: libm's vs numpy's last bits
        else:
            assert r["max_abs"] <= 2**-7 * r["scale"], r  # at most a rounding step apart


def _operands(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(m, k, generator=g))
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) / 500
    bias = torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g)
    return xq, xs, wq, ws, bias, residual


def test_reference_is_the_float_product_of_the_dequantised_operands() -> None:
    xq, xs, wq, ws, bias, residual = _operands(70, 96, 288)
    want = (
        torch.nn.functional.gelu(
            (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()
            + bias.double()
        )
        + residual.double()
    )
    got = int8_linear_reference(xq, xs, wq, ws, bias, residual, True, torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_op_compiles_in_one_graph_and_gives_the_eager_result() -> None:
    """The op is opaque to torch.compile (fullgraph: no break around it); its fake
    implementation gives the shape and dtype; off CUDA it runs the torch reference."""
    assert not fused_supported(torch.device("cpu"))
    xq, xs, wq, ws, bias, residual = _operands(45, 64, 48, seed=1)

    def fn(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows(x)
        return int8_linear(q, s, wq, ws, bias, r, True, torch.bfloat16) * 2

    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(2))
    eager = fn(x, residual)
    assert eager.shape == (45, 48) and eager.dtype == torch.bfloat16
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, residual), eager)
    q, s = quantize_rows(x)
    plain = int8_linear_reference(q, s, wq, ws, bias, residual, True, torch.bfloat16) * 2
    assert torch.equal(eager, plain)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = int8_linear(*(mode.from_tensor(t) for t in (xq, xs, wq, ws)),
                           None, None, False, torch.float16)  # fmt: skip
    assert fake.shape == (45, 48) and fake.dtype == torch.float16


def test_quantize_rows_scales_each_token_by_its_absmax() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -3.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (3,)
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    assert q[2].tolist() == [127, 0, -1]
    torch.testing.assert_close(s, torch.tensor([2.0, 1e-12, 300.0]) / 127)


def test_kernel_compiles_for_hopper_to_int8_wgmma_and_wide_stores() -> None:
    """No GPU here, but Triton compiles for one: every autotune candidate, for an H100
    (sm_90), as the GPU will specialise it (pointers 16-byte aligned; N, K and the strides
    multiples of 16). Each must become int8 warpgroup MMAs (`wgmma ... s32.s8.s8`, not a
    fallback), fit the 227 KiB of shared memory a block may have, and store its bf16
    output in 16-byte vectors (scalar stores halve the bandwidth of Swin's first stage,
    whose output is 3x its input)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.gemm_kernel import HOPPER_CONFIGS, _kernel

    pointers = {"A": "*i8", "B": "*i8", "XS": "*fp32", "WS": "*fp32", "BIAS": "*bf16",
                "RES": "*bf16", "C": "*bf16", "OS": "*fp32"}  # fmt: skip
    ints = ["M", "N", "K", "M_BUCKET", "stride_am", "stride_bn", "stride_rm", "stride_cm",
            "stride_xs", "stride_os"]  # fmt: skip
    signature = {**pointers, **dict.fromkeys(ints, "i32")}
    names = list(signature)
    aligned = [*pointers, "N", "K", "stride_am", "stride_bn", "stride_rm", "stride_cm"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    for c in HOPPER_CONFIGS:
        constexprs = {"HAS_BIAS": True, "HAS_RES": False, "GELU": True, "IS_FP8": False,
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
        assert mma and all(m.endswith(".s32.s8.s8") for m in mma), (c, mma)
        assert compiled.metadata.shared <= 227 * 1024, (c, compiled.metadata.shared)
        stores = set(re.findall(r"st\.global\.[\w.]+", ptx))
        assert stores == {"st.global.v4.b32"}, (c, stores)
