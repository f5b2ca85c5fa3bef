"""A persistent int8 / e4m3 GEMM for Hopper: operands through TMA descriptors, the same fused
epilogue as models/gemm_kernel.py (per-row and per-column scales, bias, GELU, residual),
the output stored by TMA.

Why another kernel: the tile-per-program kernel (models/gemm_kernel.py) runs SAM ViT-B's
products only 1.13x bf16's speed on an H100, where Hopper's int8 tensor cores run at twice
bf16's rate (docs/BENCHMARKS.md, issue 20, third session). Compiled for sm_90, its fastest
tiles (128x256) hold one program of 8 warps an SM at 231-241 registers, and that program
does its epilogue (scales, bias, GELU, a bf16 store of 32K values) while the tensor cores
idle; with SAM's K of 768 the main loop is only 6-12 steps, so the epilogue is a large
share of every tile (`bench/gemm_resources.py`). Here one program per SM walks the tiles
(`tl.range(..., flatten=True)`: Triton pipelines the next tile's loads under this tile's
epilogue), the loads are TMA copies into swizzled shared memory (no address arithmetic in
registers), and the epilogue may be split in two halves of the tile (`subtile`) so that
GELU's fp32 temporaries fit beside the accumulator.

Operands as models/gemm_kernel.py takes them: `xq [M, K]` and `weight [N, K]`, both
K-major; TMA also needs K * 1 byte and N * 2 bytes (the bf16 output's rows) to be multiples
of 16 and 16-byte aligned bases, which every SAM and Swin layer meets; `x_scale` may be
strided (a packed activation's scales, models.ln_quant), but the packed activation itself
is not TMA-aligned (its rows are K + 4 bytes apart), so it is refused here.

Measured on the GPU beside bf16 and the tile-per-program kernel by `bench/int8_persistent.py`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SWEEP",
    "PersistentConfig",
    "launch_persistent",
    "launch_persistent_quant_out",
    "launch_persistent_static_out",
    "persistent_for",
    "persistent_supported",
    "served_config",
]

# Whether `serve::int8_linear` / `serve::fp8_linear` run this kernel on CUDA: None decides by
# the device, the operands and the shape (`persistent_for`), True / False force it
# (bench/sam_encoder.py `--int8-gemm`, to compare it with the tile-per-program kernel).
ENABLED: bool | None = None
# The launch shape `served_config` gives every served layer in place of its own choice
# (bench/sam_encoder.py `--persistent-config`, to time the encoder with a shape of SWEEP)
SERVED: PersistentConfig | None = None
# Whether CUDA launches of the forms models/gemm_gluon.py has (a float output, or int8 by
# fixed per-column scales; no group scales) run its warp-specialised Gluon kernel instead
# (bench/sam_encoder.py `-gluon`, to compare the encoder with and without it). On an H100
# it ran SAM's int8 products 1.11-1.36x faster with the same outputs and the encoder 3-4%
# faster (docs/BENCHMARKS.md, issue 20, twenty-second session). The engine sets it from
# SERVE_KERNELS (server.engine.build.use_kernels: on for Hopper by default); off here, so
# that code importing this module alone gets this module's kernel. An AOT export keeps
# this module's kernel (a Gluon launch is not traced into a package).
GLUON: bool = False


@dataclass(frozen=True)
class PersistentConfig:
    """One launch shape: the tile, pipeline depth, warps; `subtile` stores the tile as two
    halves of BLOCK_N / 2 columns; `warp_specialize` asks Triton for producer and consumer
    warps (where this Triton supports it on the device; else the compile fails and the
    bench says so)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 128
    num_stages: int = 3
    num_warps: int = 8
    subtile: bool = True
    warp_specialize: bool = False
    programs_per_sm: int = 1
    max_registers: int | None = None

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} "
                f"w{self.num_warps}{' sub' if self.subtile else ''}"
                f"{' ws' if self.warp_specialize else ''}"
                f"{f' x{self.programs_per_sm}' if self.programs_per_sm > 1 else ''}"
                f"{f' r{self.max_registers}' if self.max_registers else ''}")  # fmt: skip


# what bench/int8_persistent.py sweeps on the GPU (a config that exceeds shared memory or
# fails to compile is reported and skipped there): 128-row tiles, 8 warps (two consumer
# warp groups) and the deep pipelines Hopper's GEMMs use; 4 warps for the narrower tile;
# Triton's warp specialisation on the two likeliest
P = PersistentConfig
SWEEP: tuple[PersistentConfig, ...] = (
    P(128, 256, 128, 3, 8, True),
    P(128, 256, 128, 3, 8, False),
    P(128, 256, 128, 4, 8, True),
    P(128, 256, 64, 3, 8, True),
    P(128, 256, 64, 3, 8, False),
    P(128, 256, 64, 4, 8, True),
    P(128, 256, 64, 4, 8, False),
    P(128, 128, 128, 3, 8, True),
    P(128, 128, 128, 4, 8, True),
    P(128, 128, 128, 4, 8, False),
    P(128, 128, 64, 4, 8, True),
    P(128, 128, 128, 4, 4, True),
    P(128, 128, 64, 4, 4, True),
    P(128, 256, 128, 3, 8, True, True),
    P(128, 128, 128, 4, 8, True, True),
    # two programs an SM, one's epilogue beside the other's main loop (sm_90 with Triton
    # 3.6, compiled here: 8 warps capped at 128 registers spill nothing in halves, and
    # their 72-96 KiB of shared memory fit twice; 4 warps take 200-253 registers)
    P(128, 128, 64, 4, 8, True, programs_per_sm=2, max_registers=128),
    P(128, 128, 128, 2, 8, True, programs_per_sm=2, max_registers=128),
    P(128, 128, 64, 4, 4, True, programs_per_sm=2),
    P(128, 128, 128, 2, 4, True, programs_per_sm=2),
    P(64, 256, 64, 3, 4, True, programs_per_sm=2),
)
del P
INTERPRETER_CONFIG = PersistentConfig(32, 32, 32, 2, 4, True, False)


_tile: Any = None  # the kernel's helpers and triton.language, set by `_kernel`
_epilogue: Any = None
tl: Any = None
quantize_rows_tile: Any = None
quantize_fixed: Any = None
dequantize_bias_gelu: Any = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def persistent_supported(xq: Tensor, weight: Tensor) -> str | None:
    """None where TMA can carry the operands, else why not (for the caller's fallback)."""
    k = xq.shape[1]
    n = weight.shape[0]
    if xq.stride(1) != 1 or weight.stride(1) != 1:
        return "operands must be K-major"
    if (xq.stride(0) % 16) or (weight.stride(0) % 16):
        return f"row strides {xq.stride(0)}, {weight.stride(0)} bytes: TMA needs multiples of 16"
    if k % 16 or n % 8:
        return f"K = {k} (a multiple of 16) and N = {n} (of 8, for the bf16 rows) needed"
    return None


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


# `ENABLED=None` sends a product here from this K and N on (Hopper): every product of SAM
# ViT-B's blocks (K and N of 768 or more) ran 1.0-1.7x the tile-per-program kernel at batch
# 8 and within 3% of it at batch 1, while Swin-T's first stages (K of 96 and 192, N down to
# 96) ran up to 1.6x slower here (H200, 2026-11-29, bench/int8_persistent.py)
AUTO_MIN_K = 768
AUTO_MIN_N = 768


def persistent_for(xq: Tensor, weight: Tensor) -> bool:
    """Whether a Linear on these operands runs here rather than in models/gemm_kernel.py."""
    if xq.device.type != "cuda" or ENABLED is False:
        return False
    if ENABLED is None and not (
        _hopper(xq.device.index or 0)
        and xq.dtype == torch.int8  # e4m3 through this kernel has not run on a GPU yet
        and xq.shape[1] >= AUTO_MIN_K
        and weight.shape[0] >= AUTO_MIN_N
    ):
        return False
    return persistent_supported(xq, weight) is None


def served_config(residual: bool, quant_out: bool = False) -> PersistentConfig:
    """The launch shape the served layers take: 128x256 tiles, K steps of 128, three stages,
    8 warps, the fastest for every SAM ViT-B product at batch 8 on an H200 (2026-11-29,
    bench/int8_persistent.py); with a residual to read, the tile stored in two halves (the
    whole tile's store and residual buffers exceed shared memory at three stages), and so
    with a quantised output, whose groups are half a tile (`HOP_GROUP`) wide.

    Not two programs an SM (SWEEP's `x2` shapes): on inputs laid out one row after another
    they ran SAM's K = 768 products in 0.74-0.79x the time, but on the packed rows the
    quantising norms write (K + 16 bytes apart) in 1.15-1.24x the whole 128x256 tile's,
    and the int8 encoder ran 458.0 / 461.9 img/s against 483.8 / 489.4 with this shape.
    With those rows 128-byte aligned (`PACK_PAD` 128) the paired shape only matched this
    one: 492.1 / 498.8 against 496.8 / 500.5 (H200, docs/BENCHMARKS.md, issue 20,
    eighteenth and nineteenth sessions)."""
    if SERVED is not None:
        return SERVED
    return PersistentConfig(128, 256, 128, 3, 8, subtile=residual or quant_out)


@functools.cache
def _kernel() -> Any:
    """Built on first use: importing this module never needs Triton."""
    # module globals: Triton resolves a kernel's callees, and the names their code uses,
    # among its module's globals
    global _tile, _epilogue, tl, quantize_rows_tile, dequantize_bias_gelu, quantize_fixed
    import triton
    import triton.language as tl

    from models.triton_quant import dequantize_bias_gelu, quantize_fixed, quantize_rows_tile

    @triton.jit
    def _tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
        # grouped order, as the tile-per-program kernel: GROUP_M row tiles share B in L2
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile_id % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _epilogue(
        acc, xs, om, on, M, N, WS, BIAS, OS, stride_os, r_desc, c_desc,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GELU: tl.constexpr,
        IS_FP8: tl.constexpr, QUANT_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
        WIDTH: tl.constexpr,
    ):  # fmt: skip
        # `xs` is None where the input's scales are in the sum already (GROUP_K) or in
        # the weight (X_SCALED off)
        offs_n = on + tl.arange(0, WIDTH)
        mask_n = offs_n < N
        y = dequantize_bias_gelu(acc, xs, WS, BIAS, offs_n, mask_n, xs is not None, HAS_BIAS,
                                 GELU)  # fmt: skip
        if HAS_RES:
            y = y + r_desc.load([om, on]).to(tl.float32)
        if QUANT_OUT == 2:
            # int8 by fixed per-column scales (OS holds their inverses): no row's maximum
            # needed, so any tile can write it (`launch_persistent_static_out`); rounded half
            # to even as torch.round, then clamped
            c_desc.store([om, on], quantize_fixed(y, tl.load(OS + offs_n, mask=mask_n, other=0.0)))
        elif QUANT_OUT == 1:
            # quantised per row of these WIDTH (= HOP_GROUP) columns, for the next GEMM
            # (models.mlp_hop): int8, or e4m3's bytes as int8; the scales at [row, group]
            offs_m = om + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            q, q_scale = quantize_rows_tile(y, mask_m[:, None] & mask_n[None, :], IS_FP8)
            c_desc.store([om, on], q)
            tl.store(OS + offs_m.to(tl.int64) * stride_os + on // WIDTH, q_scale, mask=mask_m)
        else:
            c_desc.store([om, on], y.to(c_desc.dtype))  # rows, columns past the end: clipped

    @triton.jit
    def persistent_gemm(
        a_desc, b_desc, c_desc, r_desc, XS, WS, BIAS, OS,
        M, N, K, stride_xs, stride_os, num_programs,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GELU: tl.constexpr,
        IS_FP8: tl.constexpr, GROUP_K: tl.constexpr, QUANT_OUT: tl.constexpr,
        X_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SUBTILE: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):  # fmt: skip
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        num_pid_in_group = GROUP_M * num_pid_n
        # the epilogue's own tile counter: it trails the loads' by one tile once flattened
        tile_c = start - num_programs
        for tile_id in tl.range(start, num_tiles, num_programs, flatten=True,
                                warp_specialize=WARP_SPECIALIZE):  # fmt: skip
            pid_m, pid_n = _tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            om = pid_m * BLOCK_M
            on = pid_n * BLOCK_N
            # int8 accumulates exactly in int32; e4m3, and inputs scaled per row and GROUP_K
            # columns (models.mlp_hop), in fp32
            if IS_FP8 or GROUP_K > 0:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            rows = (om + tl.arange(0, BLOCK_M)).to(tl.int64)
            for ki in range(k_tiles):
                a = a_desc.load([om, ki * BLOCK_K])  # K past the end reads zeros
                b = b_desc.load([on, ki * BLOCK_K])
                if GROUP_K > 0:
                    # each block's product times its group's scales (BLOCK_K divides GROUP_K)
                    if IS_FP8:
                        part = tl.dot(a, b.T, out_dtype=tl.float32)
                    else:
                        part = tl.dot(a, b.T, out_dtype=tl.int32).to(tl.float32)
                    gs = tl.load(XS + rows * stride_xs + (ki * BLOCK_K) // GROUP_K,
                                 mask=rows < M, other=0.0)  # fmt: skip
                    acc += part * gs[:, None]
                else:
                    acc = tl.dot(a, b.T, acc, out_dtype=acc.dtype)

            tile_c += num_programs
            pid_m, pid_n = _tile(tile_c, num_pid_in_group, num_pid_m, GROUP_M)
            om = pid_m * BLOCK_M
            on = pid_n * BLOCK_N
            offs_m = om + tl.arange(0, BLOCK_M)
            if GROUP_K > 0 or not X_SCALED:  # the input's scales in the sum, or in the weight
                xs = None
            else:
                xs = tl.load(XS + offs_m.to(tl.int64) * stride_xs, mask=offs_m < M, other=0.0)
            if SUBTILE:
                halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
                acc0, acc1 = tl.split(halves)
                _epilogue(acc0, xs, om, on, M, N, WS, BIAS, OS, stride_os, r_desc, c_desc,
                          HAS_BIAS, HAS_RES, GELU, IS_FP8, QUANT_OUT, BLOCK_M,
                          BLOCK_N // 2)  # fmt: skip
                _epilogue(acc1, xs, om, on + BLOCK_N // 2, M, N, WS, BIAS, OS, stride_os,
                          r_desc, c_desc, HAS_BIAS, HAS_RES, GELU, IS_FP8, QUANT_OUT,
                          BLOCK_M, BLOCK_N // 2)  # fmt: skip
            else:
                _epilogue(acc, xs, om, on, M, N, WS, BIAS, OS, stride_os, r_desc, c_desc,
                          HAS_BIAS, HAS_RES, GELU, IS_FP8, QUANT_OUT, BLOCK_M,
                          BLOCK_N)  # fmt: skip

    return persistent_gemm


def _exporting() -> bool:
    from models.aot import exporting

    return exporting()


def _programs(device: torch.device) -> int:
    """One program per SM (four under the interpreter, enough for several tiles each)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_persistent(
    xq: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    gelu: bool = False,
    gelu_tanh: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    config: PersistentConfig | None = None,
    group_k: int = 0,
) -> Tensor:
    """`xq [M, K]` int8 (or e4m3) x `weight [N, K]` -> `[M, N]` in `out_dtype`, scaled by
    `x_scale [M]` (may be strided) and `w_scale [N]`, then bias, GELU and residual, as
    models.gemm_kernel.launch computes it; with `group_k`, `x_scale` is `[M, K / group_k]`,
    one scale per row and group of columns (models.mlp_hop); None where the input was
    quantised by fixed per-channel scales folded into `weight` (`launch_persistent_static_out`
    writes such inputs). Raises ValueError where TMA
    cannot carry the operands (`persistent_supported`). `gelu_tanh`: GELU's tanh
    approximation (within about 3e-4 of the exact one, far inside int8's own error) with
    tanh as one SFU instruction, where the exact erf made lin1's epilogue a third of its
    time (bench/int8_persistent.py)."""
    out, _ = _launch(xq, x_scale, weight, w_scale, bias, residual, gelu, gelu_tanh, out_dtype,
                     config, group_k=group_k, quant_out=0)  # fmt: skip
    return out


def launch_persistent_static_out(
    xq: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    out_inv_scale: Tensor,
    gelu: bool = False,
    gelu_tanh: bool = False,
    config: PersistentConfig | None = None,
) -> Tensor:
    """`launch_persistent` whose output leaves as int8 `[M, N]` by fixed per-column scales:
    `round(y * out_inv_scale[col])`, clamped to +-127. Why: with scales calibrated in
    advance, SAM's lin1 can hand lin2 its input quantised without any row's maximum (which
    no tile sees); the scales fold into lin2's weight columns, so lin2 is a plain int8
    product (`x_scale=None`). On SAM ViT-B's random weights fixed per-channel scales kept
    the masks as well as per-token ones (docs/BENCHMARKS.md, issue 20; a CPU measurement)."""
    if xq.dtype != torch.int8:
        raise TypeError("a fixed-scale int8 output needs int8 operands")
    out, _ = _launch(xq, x_scale, weight, w_scale, bias, None, gelu, gelu_tanh, torch.float32,
                     config, group_k=0, quant_out=2, out_inv_scale=out_inv_scale)  # fmt: skip
    return out


def launch_persistent_quant_out(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    gelu: bool = False,
    gelu_tanh: bool = False,
    config: PersistentConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """`launch_persistent` whose output leaves quantised like its input (`[M, N]` int8 or
    e4m3), with one fp32 scale per row and `HOP_GROUP` columns (`[M, N / HOP_GROUP]`), as
    models.gemm_kernel.launch_quant_out writes it: the stored tile (or half tile) is
    `HOP_GROUP` wide."""
    return _launch(xq, x_scale, weight, w_scale, bias, None, gelu, gelu_tanh, torch.float32,
                   config, group_k=0, quant_out=1)  # fmt: skip


def _launch(
    xq: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    gelu_tanh: bool,
    out_dtype: torch.dtype,
    config: PersistentConfig | None,
    *,
    group_k: int,
    quant_out: int,
    out_inv_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """quant_out: 0 a float output, 1 int8 / e4m3 per row and HOP_GROUP columns, 2 int8 by
    fixed per-column scales (`out_inv_scale`)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from models.gemm_kernel import HOP_GROUP, check_operands

    M, K, N = check_operands(xq, weight)
    why = persistent_supported(xq, weight)
    if why is not None:
        raise ValueError(f"persistent GEMM: {why}")
    c = config or (INTERPRETER_CONFIG if _interpreting() else PersistentConfig())
    width = c.block_n // 2 if c.subtile else c.block_n
    if group_k and (K % group_k or group_k % c.block_k):
        raise ValueError(f"group_k {group_k}: it must divide K = {K} and BLOCK_K must divide it")
    if quant_out == 1 and (width != HOP_GROUP or N % HOP_GROUP or residual is not None):
        raise ValueError(f"a quantised output: stored tiles {HOP_GROUP} wide (got {width}), "
                         f"N % {HOP_GROUP} == 0 (N = {N}), no residual")  # fmt: skip
    if quant_out == 2 and (out_inv_scale is None or out_inv_scale.shape != (N,)):
        raise ValueError(f"a fixed-scale output needs out_inv_scale [{N}]")
    if group_k and x_scale is None:
        raise ValueError("group_k needs the input's group scales")
    same_type = residual is None or residual.dtype == out_dtype
    gluon_form = not group_k and quant_out != 1 and same_type  # what the Gluon kernel has
    if GLUON and gluon_form and xq.device.type == "cuda" and not _exporting():
        from models.gemm_gluon import launch_gluon

        out = launch_gluon(xq, x_scale, weight, w_scale, bias, residual, gelu=gelu,
                           gelu_tanh=gelu_tanh, out_dtype=out_dtype,
                           out_inv_scale=out_inv_scale if quant_out == 2 else None)  # fmt: skip
        return out, torch.empty(M, 0, device=xq.device)
    out = torch.empty(M, N, dtype=torch.int8 if quant_out else out_dtype, device=xq.device)
    out_scale = torch.empty(M, N // HOP_GROUP if quant_out == 1 else 0, device=xq.device)
    if M == 0:
        return (out.view(xq.dtype) if quant_out == 1 else out), out_scale
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    a_desc = TensorDescriptor.from_tensor(xq, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    c_desc = TensorDescriptor.from_tensor(out, [c.block_m, width])
    r_desc = TensorDescriptor.from_tensor(residual if residual is not None else out,
                                          [c.block_m, width])  # fmt: skip
    w_scale = w_scale.float().contiguous()
    x_scaled = x_scale is not None
    x_scale = w_scale if x_scale is None else x_scale  # None: a placeholder, never read
    x_scale = x_scale if x_scale.dtype == torch.float32 else x_scale.float()
    if quant_out == 2:
        assert out_inv_scale is not None
        out_scale = out_inv_scale.float().contiguous()
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    programs = min(tiles, _programs(xq.device) * c.programs_per_sm)
    registers = {"maxnreg": c.max_registers} if c.max_registers else {}
    _kernel()[(programs,)](
        a_desc, b_desc, c_desc, r_desc, x_scale, w_scale,
        bias if bias is not None else w_scale,  # placeholder pointers, never read
        out_scale if quant_out else w_scale,
        M, N, K, x_scale.stride(0), out_scale.stride(0) if quant_out == 1 else 0, programs,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        GELU=(3 if _interpreting() else 2) if gelu and gelu_tanh else int(gelu),
        IS_FP8=xq.dtype == torch.float8_e4m3fn, GROUP_K=group_k, QUANT_OUT=quant_out,
        X_SCALED=x_scaled,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=8,
        SUBTILE=c.subtile, WARP_SPECIALIZE=c.warp_specialize,
        num_stages=c.num_stages, num_warps=c.num_warps, **registers,
    )  # fmt: skip
    return (out.view(xq.dtype) if quant_out == 1 else out), out_scale
