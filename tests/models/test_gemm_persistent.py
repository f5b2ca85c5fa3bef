"""The persistent TMA GEMM (models.gemm_persistent) against its torch reference, where the
served op sends a product, and what it compiles to for Hopper.

No GPU in CI: the kernel runs in Triton's interpreter (a subprocess, `TRITON_INTERPRET=1`),
TMA descriptors included, with four programs that each walk several tiles, so the
persistent loop's tile order and the epilogue's trailing tile counter are exercised; speed
is measured on the GPU by bench/int8_persistent.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from bench.gemm_resources import resources
from models import gemm_persistent
from models.gemm_persistent import (
    SWEEP,
    PersistentConfig,
    persistent_for,
    persistent_supported,
    served_config,
)
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
from models.gemm_persistent import PersistentConfig, launch_persistent
from models.int8_gemm import int8_linear_reference, quantize_rows
from models.ln_quant import pack_rows, unpack_rows

results = []
for seed, case in enumerate(json.loads(sys.argv[1])):
    M, K, N, bias, gelu, tanh, residual, dtype, packed, cfg = case
    g = torch.Generator().manual_seed(seed)
    out_dtype = getattr(torch, dtype)
    xq, xs = quantize_rows(torch.randn(M, K, generator=g))
    if packed:  # the layer norm's packed rows: K + 16 bytes apart, the scale in the padding
        xq, xs = unpack_rows(pack_rows(xq, xs), False)
    wq, ws = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(M, N, generator=g).to(out_dtype) if residual else None
    out = launch_persistent(xq, xs, wq, ws, b, r, gelu=gelu, gelu_tanh=tanh,
                            out_dtype=out_dtype, config=PersistentConfig(*cfg))
    if tanh:
        ref = int8_linear_reference(xq, xs, wq, ws, b, None, False, torch.float32)
        ref = F.gelu(ref, approximate="tanh") + (r.float() if r is not None else 0)
    else:
        ref = int8_linear_reference(xq, xs, wq, ws, b, r, gelu, torch.float32)
    diff = (out.float() - ref).abs().max()
    results.append({"shape": list(out.shape), "dtype": str(out.dtype), "max_abs": float(diff),
                    "scale": float(ref.abs().max())})
print(json.dumps(results))
"""

CASES = [
    # M, K, N, bias, GELU, tanh form, residual, out dtype, packed input,
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, subtile, warp_specialize)
    (200, 96, 96, True, False, False, False, "float32", False, (32, 32, 32, 2, 4, True, False)),
    (77, 64, 80, True, True, False, True, "float32", False, (32, 32, 32, 2, 4, False, False)),
    (130, 48, 64, False, True, True, False, "bfloat16", True, (32, 64, 32, 2, 4, True, False)),
    (45, 128, 48, True, False, False, True, "bfloat16", True, (16, 16, 64, 2, 4, True, False)),
    (64, 32, 32, True, True, True, True, "float16", False, (32, 32, 32, 2, 4, False, False)),
]


def test_kernel_matches_the_torch_reference_in_the_interpreter() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for r, case in zip(results, CASES, strict=True):
        m, _, n, _, _, _, _, dtype, _, _ = case
        assert r["shape"] == [m, n] and r["dtype"] == f"torch.{dtype}", r
        # fp32 out: the same epilogue up to the erf's and tanh's last bits; bf16 / fp16 out:
        # at most one rounding step of the output apart
        limit = 1e-5 if dtype == "float32" else 2**-7
        assert r["max_abs"] <= limit * r["scale"], r


HOP_SCRIPT = r"""
import json, sys
import torch
from models.gemm_persistent import (PersistentConfig, launch_persistent,
                                    launch_persistent_quant_out)
from models.int8_gemm import quantize_rows
from models.ln_quant import pack_rows, unpack_rows
from models.mlp_hop import linear_from_groups_reference, linear_to_groups_reference

results = []
for seed, (M, K, N, N2, packed) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(M, K, generator=g))
    if packed:
        xq, xs = unpack_rows(pack_rows(xq, xs), False)
    w1q, w1s = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    b1 = torch.randn(N, generator=g)
    # lin1 with its output quantised per row and 128 columns: halves of a 256-wide tile
    q, qs = launch_persistent_quant_out(xq, xs, w1q, w1s, b1, gelu=True,
                                        config=PersistentConfig(32, 256, 32, 2, 4, True))
    rq, rqs = linear_to_groups_reference(xq, xs, w1q, w1s, b1, True)
    # lin2 from those groups, its residual fused
    w2q, w2s = quantize_rows(torch.randn(N2, N, generator=g) / N**0.5)
    b2, r = torch.randn(N2, generator=g), torch.randn(M, N2, generator=g)
    out = launch_persistent(rq, rqs, w2q, w2s, b2, r, out_dtype=torch.float32, group_k=128,
                            config=PersistentConfig(32, 32, 64, 2, 4, True))
    ref = linear_from_groups_reference(rq, rqs, w2q, w2s, b2, r, torch.float32)
    results.append({"q_shape": list(q.shape), "scale_shape": list(qs.shape),
                    "q_off": int((q.int() - rq.int()).abs().max()),
                    "scale_rel": float(((qs - rqs).abs().max() / rqs.abs().max())),
                    "out_rel": float((out - ref).abs().max() / ref.abs().max())})
print(json.dumps(results))
"""
HOP_CASES = [(70, 96, 256, 64, False), (33, 48, 512, 40, True)]


def test_the_mlp_hop_matches_models_mlp_hop_in_the_interpreter() -> None:
    """lin1's epilogue quantises each row's 128 columns as models.mlp_hop's reference does
    (a value at most one step off: the GELU's last bits at a rounding edge), and lin2 sums
    each 128-column group's product times its scales."""
    for r, (m, _, n, _, _) in zip(run_interpreted(HOP_SCRIPT, HOP_CASES), HOP_CASES,
                                  strict=True):  # fmt: skip
        assert r["q_shape"] == [m, n] and r["scale_shape"] == [m, n // 128], r
        assert r["q_off"] <= 1 and r["scale_rel"] < 1e-5, r
        assert r["out_rel"] < 1e-5, r


STATIC_SCRIPT = r"""
import json, sys
import torch
from models.gemm_persistent import (PersistentConfig, launch_persistent,
                                    launch_persistent_static_out)
from models.int8_gemm import int8_linear_reference, quantize_rows

results = []
for seed, (M, K, N, N2, subtile) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(M, K, generator=g))
    w1q, w1s = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    b1 = torch.randn(N, generator=g)
    inv = 127.0 / (torch.rand(N, generator=g) * 3 + 0.5)  # fixed per-column scales
    q = launch_persistent_static_out(xq, xs, w1q, w1s, b1, out_inv_scale=inv, gelu=True,
                                     config=PersistentConfig(32, 64, 32, 2, 4, subtile))
    y = int8_linear_reference(xq, xs, w1q, w1s, b1, None, True, torch.float32)
    ref = torch.round(y * inv).clamp(-127, 127).to(torch.int8)
    # lin2 on it: the scales folded into its weight's columns, no row scales
    w2q, w2s = quantize_rows(torch.randn(N2, N, generator=g) / N**0.5 / inv[None, :])
    out = launch_persistent(ref, None, w2q, w2s, None, None, out_dtype=torch.float32,
                            config=PersistentConfig(32, 32, 32, 2, 4, subtile))
    want = (ref.float() @ w2q.float().t()) * w2s
    results.append({"dtype": str(q.dtype), "off": int((q.int() - ref.int()).abs().max()),
                    "saturated": int((ref.abs() == 127).sum()),
                    "out_rel": float((out - want).abs().max() / want.abs().max())})
print(json.dumps(results))
"""
STATIC_CASES = [(70, 96, 96, 48, True), (45, 64, 128, 32, False)]


def test_fixed_scale_int8_out_and_an_input_without_row_scales_in_the_interpreter() -> None:
    """lin1 writes int8 by fixed per-column scales exactly as torch rounds and clamps them
    (some values saturate), and lin2 reads it as a plain int8 product (no row scales)."""
    results = run_interpreted(STATIC_SCRIPT, STATIC_CASES)
    for r in results:
        assert r["dtype"] == "torch.int8" and r["off"] == 0, r
        assert r["out_rel"] < 1e-6, r
    assert any(r["saturated"] for r in results)


def test_what_the_served_op_sends_here() -> None:
    """TMA needs K-major operands and rows 16 bytes apart; `ENABLED=None` keeps the CPU and
    Swin's narrow early products on the tile-per-program kernel."""
    xq = torch.zeros(64, 768, dtype=torch.int8)
    w = torch.zeros(2304, 768, dtype=torch.int8)
    assert persistent_supported(xq, w) is None
    assert "16" in (persistent_supported(torch.zeros(64, 776, dtype=torch.int8)[:, :770],
                                         torch.zeros(8, 770, dtype=torch.int8)) or "")  # fmt: skip
    assert persistent_supported(xq.t(), w) is not None  # column-major
    assert not persistent_for(xq, w)  # the CPU: never, whatever ENABLED says
    was = gemm_persistent.ENABLED
    try:
        gemm_persistent.ENABLED = True
        assert not persistent_for(xq, w)
    finally:
        gemm_persistent.ENABLED = was
    assert served_config(residual=True).subtile and not served_config(residual=False).subtile


def test_launch_refuses_operands_tma_cannot_carry() -> None:
    from models.gemm_persistent import launch_persistent

    xq = torch.zeros(32, 24, dtype=torch.int8)  # K = 24: rows of 24 bytes
    with pytest.raises(ValueError, match="persistent GEMM"):
        launch_persistent(xq, torch.ones(32), torch.zeros(16, 24, dtype=torch.int8),
                          torch.ones(16))  # fmt: skip


def _compile_for_hopper(
    c: PersistentConfig,
    gelu: int,
    residual: bool,
    group_k: int = 0,
    quant_out: int = 0,
    x_scaled: bool = True,
    maxnreg: int | None = None,
):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(dtype: torch.dtype, block: list[int]) -> str:
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=dtype), block))

    width = c.block_n // 2 if c.subtile else c.block_n
    fn = gemm_persistent._kernel()
    signature = {
        "a_desc": desc(torch.int8, [c.block_m, c.block_k]),
        "b_desc": desc(torch.int8, [c.block_n, c.block_k]),
        "c_desc": desc(torch.bfloat16, [c.block_m, width]),
        "r_desc": desc(torch.bfloat16, [c.block_m, width]),
        "XS": "*fp32", "WS": "*fp32", "BIAS": "*fp32", "OS": "*fp32",
        "M": "i32", "N": "i32", "K": "i32", "stride_xs": "i32", "stride_os": "i32",
        "num_programs": "i32",
    }  # fmt: skip
    if quant_out:
        signature["c_desc"] = desc(torch.int8, [c.block_m, width])
    constexprs = {"HAS_BIAS": True, "HAS_RES": residual, "GELU": gelu, "IS_FP8": False,
                  "GROUP_K": group_k, "QUANT_OUT": quant_out, "X_SCALED": x_scaled,
                  "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                  "GROUP_M": 8, "SUBTILE": c.subtile,
                  "WARP_SPECIALIZE": c.warp_specialize}  # fmt: skip
    names = fn.arg_names
    source = ASTSource(
        fn,
        {**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ("N", "K")},
    )
    options: dict[str, int] = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def test_served_shapes_compile_for_hopper_to_int8_wgmma_tma_and_the_sfu_tanh() -> None:
    """The served launch shapes, for an H100 (sm_90): int8 warpgroup MMAs fed by TMA
    (`cp.async.bulk.tensor`), stored by TMA, within 227 KiB of shared memory; GELU's tanh
    form as the one `tanh.approx.f32` instruction."""
    shapes = [(served_config(False), 0, False, 0, 0, True),
              (served_config(False), 2, False, 0, 0, True),
              (served_config(True), 0, True, 0, 0, True),
              # the MLP hop: lin1 writes int8 per 128 columns, lin2 reads them
              (served_config(False, quant_out=True), 2, False, 0, 1, True),
              (served_config(True), 0, True, 128, 0, True),
              # fixed scales: lin1 writes int8 by column, lin2 reads it with no row scales
              (served_config(False), 2, False, 0, 2, True),
              (served_config(True), 0, True, 0, 0, False)]  # fmt: skip
    for config, gelu, residual, group_k, quant_out, x_scaled in shapes:
        compiled = _compile_for_hopper(config, gelu, residual, group_k, quant_out, x_scaled)
        ptx = compiled.asm["ptx"]
        mma = set(re.findall(r"wgmma\.mma_async\.[\w.]+", ptx))
        assert mma and all(m.endswith(".s32.s8.s8") for m in mma), mma
        assert "cp.async.bulk.tensor" in ptx
        assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
        assert ("tanh.approx.f32" in ptx) == (gelu == 2)


def test_paired_shapes_fit_two_programs_an_sm() -> None:
    """SWEEP's `x2` shapes (two programs an SM, one's epilogue beside the other's main
    loop) measure what they claim only if two fit beside each other in an SM's registers
    (allocated 8 a thread at a time) and shared memory (228 KiB, 1 KiB more a program),
    spilling nothing; else the second program waits for the first."""
    paired = [c for c in SWEEP if c.programs_per_sm > 1]
    assert {c.num_warps for c in paired} == {4, 8}
    for config in (next(c for c in paired if c.num_warps == w) for w in (4, 8)):
        # the launch passes `max_registers` to Triton as `maxnreg`
        compiled = _compile_for_hopper(config, 0, False, maxnreg=config.max_registers)
        used = resources(compiled)
        assert used["stack_bytes"] == 0 and used["local_bytes"] == 0, (config, used)
        registers = -(-used["registers"] // 8) * 8 * 32 * config.num_warps
        assert registers * config.programs_per_sm <= 65536, (config, used)
        shared = compiled.metadata.shared + 1024
        assert shared * config.programs_per_sm <= 228 * 1024, (config, used)


def test_sweep_is_distinct_and_holds_the_served_shapes() -> None:
    assert len(set(SWEEP)) == len(SWEEP)
    assert served_config(False) in SWEEP and served_config(True) in SWEEP
