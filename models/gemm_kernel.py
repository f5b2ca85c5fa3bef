"""The Triton GEMM behind `models.int8_gemm` and `models.fp8_gemm` (moved out of
models/int8_gemm.py, which re-exports it): int8 x int8 -> int32 or e4m3 x e4m3 -> fp32 in
the tensor cores, the dequantisation, bias, GELU and residual in the epilogue; inputs
scaled per row, or per row and 128 columns (`group_k`); the output in a float dtype, or
quantised per row and 128 columns for the next GEMM (`launch_quant_out`, models.mlp_hop).
Why, and the operands' layout: models/int8_gemm.py's docstring.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CONFIG",
    "HOPPER_CONFIGS",
    "HOP_CONFIGS",
    "HOP_GROUP",
    "GemmConfig",
    "check_operands",
    "launch",
    "launch_quant_out",
]


class GemmConfig:
    """One launch shape: tiles, pipeline depth, warps (what `launch(config=...)` takes; the
    tests run several in the interpreter, the bench sweeps them on the GPU)."""

    def __init__(
        self, block_m: int, block_n: int, block_k: int, num_stages: int, num_warps: int
    ) -> None:
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k
        self.num_stages, self.num_warps = num_stages, num_warps

    def __repr__(self) -> str:
        return (f"GemmConfig({self.block_m}, {self.block_n}, {self.block_k}, "
                f"stages={self.num_stages}, warps={self.num_warps})")  # fmt: skip


# Hopper (H100) candidates. Large tiles with deep pipelines for the compute-bound products
# (K >= 384); BLOCK_K 32 and narrow N tiles for Swin's first stage (K = 96, N = 96/288/384):
# there the product is bound by memory (the bf16 output is 3x the int8 input), and a tile
# that divides K and N wastes no loads. Configs whose BLOCK_K exceeds K are pruned.
HOPPER_CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(128, 256, 64, 3, 8),
    GemmConfig(256, 128, 64, 3, 8),
    GemmConfig(128, 128, 128, 3, 8),
    GemmConfig(128, 128, 64, 4, 8),
    GemmConfig(128, 128, 64, 4, 4),
    GemmConfig(128, 64, 64, 4, 4),
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 128, 32, 4, 4),
    GemmConfig(128, 64, 32, 4, 4),
    GemmConfig(256, 64, 32, 3, 8),
    GemmConfig(128, 32, 32, 4, 4),
    GemmConfig(64, 64, 32, 4, 4),
)
# what the interpreter (tests) and an explicit `launch` without a config use
DEFAULT_CONFIG = GemmConfig(64, 64, 32, 3, 4)
# a quantised output (models.mlp_hop) has one scale per row and HOP_GROUP columns: its
# tiles are that wide
HOP_GROUP = 128
HOP_CONFIGS = tuple(c for c in HOPPER_CONFIGS if c.block_n == HOP_GROUP)
INTERPRETER_HOP_CONFIG = GemmConfig(32, HOP_GROUP, 32, 2, 4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# models.triton_quant's, set when the kernel is built
quantize_rows_tile: Any = None
dequantize_bias_gelu: Any = None


@functools.cache
def _kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton."""
    import triton
    import triton.language as tl

    # a module global: Triton resolves a kernel's callees among its module's globals
    global quantize_rows_tile, dequantize_bias_gelu
    from models.triton_quant import dequantize_bias_gelu, quantize_rows_tile

    @triton.jit
    def int8_gemm_epilogue(
        A, B, XS, WS, BIAS, RES, C, OS,
        M, N, K, M_BUCKET,
        stride_am, stride_bn, stride_rm, stride_cm, stride_xs, stride_os,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GELU: tl.constexpr,
        IS_FP8: tl.constexpr, GROUP_K: tl.constexpr, QUANT_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # M_BUCKET only keys the autotuner (one choice per size class of M).
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles sweep the columns together, sharing B in L2
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows / columns past the end read row 0 / column 0 again (no M or N mask in the
        # loop); the store below is masked, so they are computed and dropped
        offs_am = tl.where(offs_m < M, offs_m, 0)
        offs_bn = tl.where(offs_n < N, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        # row offsets in int64: M x N passes 2^31 from Swin-T's batch 2048 on
        a_ptrs = A + offs_am.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + offs_bn[:, None] * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        # int8 accumulates exactly in int32; fp8 (e4m3, models.fp8_gemm) and products of
        # group-scaled inputs (GROUP_K, models.mlp_hop) in fp32
        if IS_FP8 or GROUP_K > 0:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            # masked along K only (as Triton's matmul tutorial): our layers' K is a multiple
            # of 16, which Triton is told, so the loads stay 16-byte vectors
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            if GROUP_K > 0:
                # one scale per row and GROUP_K columns of A (BLOCK_K divides GROUP_K): each
                # block's product is scaled by its group's before it joins the sum
                if IS_FP8:
                    part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
                else:
                    part = tl.dot(a, tl.trans(b), out_dtype=tl.int32).to(tl.float32)
                group = (k * BLOCK_K) // GROUP_K
                gs = tl.load(XS + offs_am.to(tl.int64) * stride_xs + group)
                acc += part * gs[:, None]
            else:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=acc.dtype)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        # the epilogue, in fp32, in the order of int8_linear_reference
        mask_m = offs_m < M
        mask_n = offs_n < N
        # strided: a packed activation (models.ln_quant) keeps each scale after its row;
        # with GROUP_K the input's scales are in the sum already
        xs = tl.load(XS + offs_m.to(tl.int64) * stride_xs, mask=mask_m & (GROUP_K == 0),
                     other=0.0)  # fmt: skip
        y = dequantize_bias_gelu(acc, xs, WS, BIAS, offs_n, mask_n, GROUP_K == 0, HAS_BIAS,
                                 GELU)  # fmt: skip
        mask = mask_m[:, None] & mask_n[None, :]
        if HAS_RES:
            r_ptrs = RES + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :]
            y = y + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        if QUANT_OUT:
            # the output quantised per row of this tile (BLOCK_N columns: models.mlp_hop's
            # group), as int8 or e4m3's bytes, its scales at [row, pid_n] of OS
            q, q_scale = quantize_rows_tile(y, mask, IS_FP8)
            tl.store(c_ptrs, q, mask=mask)
            tl.store(OS + offs_m.to(tl.int64) * stride_os + pid_n, q_scale, mask=mask_m)
        else:
            tl.store(c_ptrs, y.to(C.dtype.element_ty), mask=mask)

    return int8_gemm_epilogue


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Drop tiles larger than the problem (BLOCK_K > K, BLOCK_N > 2N); keep at least one."""
    k, n = named_args["K"], named_args["N"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= max(k, 16)
            and c.kwargs["BLOCK_N"] <= max(2 * n, 16)]  # fmt: skip
    return kept or configs[-1:]


@functools.cache
def _autotuned(candidates: tuple[GemmConfig, ...] = HOPPER_CONFIGS) -> Any:
    """The kernel under `triton.autotune`, keyed by (size class of M, N, K). Results are kept
    in Triton's cache directory where this Triton can (`cache_results`): a restart with
    `SERVE_COMPILE_CACHE` (TRITON_CACHE_DIR) skips the tuning."""
    import triton

    configs = [
        triton.Config(
            {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": 8},
            num_stages=c.num_stages,
            num_warps=c.num_warps,
        )
        for c in candidates
    ]
    options: dict[str, Any] = {"prune_configs_by": {"early_config_prune": _prune}}
    accepted = inspect.signature(triton.autotune).parameters
    if "cache_results" in accepted:
        options["cache_results"] = True
    if "warmup" in accepted:  # a few ms per candidate: tuning ~20 shapes at warm-up
        options["warmup"], options["rep"] = 5, 25
    key = ["M_BUCKET", "N", "K", "GROUP_K", "QUANT_OUT"]
    return triton.autotune(configs, key=key, **options)(_kernel())


def _m_bucket(m: int) -> int:
    """The autotuner's size class of M: powers of two from 1024 (a few classes per model)."""
    return 1 << max(10, (m - 1).bit_length())


def check_operands(xq: Tensor, weight: Tensor) -> tuple[int, int, int]:
    """M, K, N of `xq [M, K]` x `weight [N, K]`, both int8 or both e4m3 (this kernel's and
    models.gemm_persistent's operands), else why not."""
    m, k = xq.shape
    if weight.shape[1] != k:
        raise ValueError(f"activation [{m}, {k}] and weight {tuple(weight.shape)} differ in K")
    if xq.dtype != weight.dtype or xq.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"operands {xq.dtype} x {weight.dtype}: both int8 or both float8_e4m3fn")
    return m, k, weight.shape[0]


def launch(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    gelu: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
    group_k: int = 0,
) -> Tensor:
    """Run the kernel: `xq [M, K]` int8, `x_scale [M]`, `weight [N, K]` int8, `w_scale [N]`,
    `bias [N]`, `residual [M, N]` -> `[M, N]` in `out_dtype`. `xq` and `weight` may both be
    float8 e4m3 instead (`models.fp8_gemm`: the same kernel, fp32 accumulation); `x_scale`
    may be strided (a packed activation's, `models.ln_quant`), or with `group_k` be
    `[M, K / group_k]`, one scale per row and group of columns (`models.mlp_hop`).

    Autotuned unless `config` is given (under the interpreter, which cannot time them,
    among `DEFAULT_CONFIG` alone). Model code reaches it through `int8_linear`; called
    directly by the tests and bench/int8_gemm.py.
    """
    out, _ = _launch(xq, x_scale, weight, w_scale, bias, residual, gelu, out_dtype, config,
                     group_k=group_k, quant_out=False)  # fmt: skip
    return out


def launch_quant_out(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    gelu: bool = False,
    config: GemmConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """`launch` whose output leaves quantised like its input (int8 or e4m3, `[M, N]`), with
    one fp32 scale per row and `HOP_GROUP` columns (`[M, N / HOP_GROUP]`): each output tile
    is `HOP_GROUP` wide and quantised in the epilogue (models.mlp_hop)."""
    return _launch(xq, x_scale, weight, w_scale, bias, None, gelu, torch.float32, config,
                   group_k=0, quant_out=True)  # fmt: skip


def _launch(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
    config: GemmConfig | None,
    *,
    group_k: int,
    quant_out: bool,
) -> tuple[Tensor, Tensor]:
    import triton

    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    M, K, N = check_operands(xq, weight)
    fp8 = xq.dtype == torch.float8_e4m3fn
    if group_k and (group_k % 128 or K % group_k):
        raise ValueError(f"group_k {group_k}: a multiple of 128 (every BLOCK_K divides it) "
                         f"that divides K = {K}")  # fmt: skip
    if quant_out and (N % HOP_GROUP or residual is not None):
        raise ValueError(f"a quantised output needs N % {HOP_GROUP} == 0 and no residual")
    # a quantised output: int8, or e4m3's bytes as int8 (viewed back as e4m3 below)
    out = torch.empty(M, N, dtype=torch.int8 if quant_out else out_dtype, device=xq.device)
    out_scale = torch.empty(M, N // HOP_GROUP if quant_out else 0, device=xq.device)
    if M == 0:
        return (out.view(xq.dtype) if quant_out else out), out_scale
    x_scale = x_scale if x_scale.dtype == torch.float32 else x_scale.float()
    w_scale = w_scale.float().contiguous()
    args = (
        xq, weight, x_scale, w_scale,
        bias if bias is not None else w_scale,  # a placeholder pointer, never read
        residual if residual is not None else out,
        out, out_scale if quant_out else w_scale,
        M, N, K, _m_bucket(M),
        xq.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), x_scale.stride(0),
        out_scale.stride(0) if quant_out else 0,
    )  # fmt: skip
    flags = {"HAS_BIAS": bias is not None, "HAS_RES": residual is not None, "GELU": gelu,
             "IS_FP8": fp8, "GROUP_K": group_k, "QUANT_OUT": quant_out}  # fmt: skip
    if config is None:
        # the interpreter cannot time candidates: one, through the same autotuner
        if quant_out:
            tuned = _autotuned((INTERPRETER_HOP_CONFIG,) if _interpreting() else HOP_CONFIGS)
        else:
            tuned = _autotuned((DEFAULT_CONFIG,) if _interpreting() else HOPPER_CONFIGS)

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        tuned[grid](*args, **flags)
    else:
        c = config
        if quant_out and c.block_n != HOP_GROUP:
            raise ValueError(f"a quantised output is written in tiles {HOP_GROUP} wide: {c}")
        grid_1d = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n),)
        _kernel()[grid_1d](
            *args, **flags,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=8,
            num_stages=c.num_stages, num_warps=c.num_warps,
        )  # fmt: skip
    return (out.view(xq.dtype) if quant_out else out), out_scale
