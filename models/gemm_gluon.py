"""A warp-specialised int8 / e4m3 GEMM for Hopper written in Gluon: one producer warp
feeds a ring of shared-memory stages by TMA, and two consumer warp groups take output
tiles in turn, so that one group's epilogue (scales, bias, GELU, residual, the store) runs
while the other's `wgmma`s keep the tensor cores busy.

Why: models/gemm_persistent.py (Triton's `tl.dot`) runs SAM ViT-B's int8 products at
770-1,060 TFLOP/s (H200), 39-54% of Hopper's dense int8 peak of 1,979 TOPS: one program an
SM does its tile's epilogue while its tensor cores idle, and with SAM's K of 768 the main
loop is only six steps of 128, so the epilogue is a large share of every tile
(docs/BENCHMARKS.md, issue 20). Triton 3.6's own warp specialisation did not change that
on Hopper (the same page, fourteenth session). CUTLASS's "ping-pong" schedule is the known
answer: two consumer warp groups, each with a whole tile, whose main loops alternate on
the tensor cores. Gluon (`triton.experimental.gluon`, in the GPU machine's Triton) exposes
what it needs: `warp_specialize`, `warpgroup_mma`, `mbarrier` and TMA.

The arithmetic is models.gemm_persistent's (the order of models.int8_gemm's reference):
`acc * x_scale[row] * w_scale[col] + bias`, GELU (tanh form with the SFU's tanh, or the
exact erf), `+ residual`, stored as bf16 / fp32 or, with fixed per-column scales, as
int8. The MLP hop's group scales (GROUP_K, a quantised output per row) stay with the
Triton kernel. Gluon has no interpreter, so this kernel runs only on a Hopper GPU; the CPU
tests compile it for sm_90 and check what it compiles to (tests/models/test_gemm_gluon.py),
and bench/gemm_gluon.py checks its numbers against torch and the Triton kernel on the GPU.

Measured on an H100 (2026-12-07, SAM ViT-B's products at batch 8): the same outputs as the
persistent kernel, 1.11-1.36x its speed (704-1,204 TFLOP/s); the int8 encoder 3-4% faster
with it (docs/BENCHMARKS.md, issue 20, twenty-second session). As fast as the vendor's fp8
rowwise kernel (`torch._scaled_mm`) on every one of those products, twice cuBLASLt's int8.

Where an epilogue has nothing to hide (qkv: scales and bias, bf16 out) the product is bound
by L2's bandwidth instead (ncu: L2 89% busy): each 128 x 128 tile brings A's and B's rows
for K = 768. There both groups share one 128 x 256 tile (`GluonConfig.coop`), A's rows
loaded once for the two: qkv 1.06-1.10x faster, the others slower, their epilogues no
longer under a main loop (the same page, twenty-fifth session; `served_config`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["GluonConfig", "launch_gluon", "served_config"]


@dataclass(frozen=True)
class GluonConfig:
    """A launch shape: each consumer warp group owns a `block_m x block_n` tile (its int32
    accumulator is block_m * block_n / 128 registers a thread: 128 at 128x128); `stages`
    ring slots of `block_k` columns of both operands; the consumers' register budget (the
    producer warp takes 40, the rest of the SM's 64K go to the consumers)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    stages: int = 4
    consumer_registers: int = 232
    # both groups on one `block_m x 2 block_n` tile, each its half of the columns, the
    # rows of A loaded once for the two: a quarter fewer bytes from L2 a product, the
    # epilogues no longer under the other group's main loop (the producer fills the ring
    # under them). Slots are then 1.5x larger: 3 fit.
    coop: bool = False

    @property
    def tile_n(self) -> int:
        """A tile's columns, B's rows in a ring slot: both groups' halves where `coop`."""
        return 2 * self.block_n if self.coop else self.block_n

    def __str__(self) -> str:
        return (f"gluon {self.block_m}x{self.block_n}x{self.block_k} s{self.stages} "
                f"r{self.consumer_registers}{' coop' if self.coop else ''}")  # fmt: skip


# The plain products (a float output, no residual, no GELU: SAM's qkv) on 128 x 256 tiles
# shared by both groups where N allows (`COOP_PLAIN`): on an H100 at batch 8 SAM's qkv ran
# 1.06-1.10x faster so, bound by L2's bandwidth (ncu: L2 89% busy, 128 x 128 tiles); the
# products with an epilogue to hide (proj, lin1, lin2) 3-18% slower (docs/BENCHMARKS.md,
# issue 20, twenty-fifth session). bench/sam_encoder.py `-pingpong` turns it off.
COOPERATIVE: bool = True
COOP_PLAIN = GluonConfig(128, 128, 128, 3, coop=True)

PRODUCER_REGISTERS = 40
# three warp groups an SM: two consumers and the producer's (one warp, padded to a group)
KERNEL_MAX_REGISTERS = 168

gl: Any = None  # set by `_kernel`: Triton resolves a kernel's names among module globals
gluon: Any = None
tma: Any = None
mbarrier: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
tma_load: Any = None  # TMA's copies under this Triton's names (3.6: async_copy_*;
tma_store: Any = None  # later: async_load / async_store)
_ws_tile: Any = None
dequantize_bias_gelu: Any = None
quantize_fixed: Any = None
_ws_grid: Any = None
_ws_producer: Any = None
_ws_consumer: Any = None
_ws_epilogue: Any = None


def tma_copies(tma: Any) -> tuple[Any, Any]:
    """TMA's load and store under this Triton's names (3.6: async_copy_*; later:
    async_load / async_store)."""
    if hasattr(tma, "async_load"):
        return tma.async_load, tma.async_store
    return tma.async_copy_global_to_shared, tma.async_copy_shared_to_global


@functools.cache
def _kernel() -> Any:
    """Built on first use: importing this module never needs Triton."""
    global gl, gluon, tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    global dequantize_bias_gelu, quantize_fixed, _ws_tile, _ws_grid, _ws_producer
    global _ws_consumer, _ws_epilogue, tma_load, tma_store
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    tma_load, tma_store = tma_copies(tma)

    # the grouped tile order of models/gemm_persistent.py (GROUP_M row tiles share B in L2):
    # its scalar arithmetic compiles in a Gluon kernel as it is
    from models import gemm_persistent

    gemm_persistent._kernel()
    _ws_tile = gemm_persistent._tile
    from models.triton_quant import dequantize_bias_gelu, quantize_fixed

    @gluon.jit
    def _ws_grid(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        return num_pid_m, num_pid_n, num_pid_m * num_pid_n, gl.cdiv(K, BLOCK_K)

    @gluon.jit
    def _ws_producer(
        a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, num_programs,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        # every tile of this program in order, each K step into the next ring slot
        start = gl.program_id(0)
        num_pid_m, num_pid_n, num_tiles, k_tiles = _ws_grid(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        step = 0
        for tile_id in range(start, num_tiles, num_programs):
            pid_m, pid_n = _ws_tile(tile_id, GROUP_M * num_pid_n, num_pid_m, GROUP_M)
            om = pid_m * BLOCK_M
            on = pid_n * BLOCK_N
            for ki in range(k_tiles):
                s = step % STAGES
                # a slot starts empty: the first pass waits on the phase before it
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s),
                                a_desc.block_type.nbytes + b_desc.block_type.nbytes)  # fmt: skip
                tma_load(a_desc, [om, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
                tma_load(b_desc, [on, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
                step += 1

    @gluon.jit
    def _ws_epilogue(
        acc, om, on, M, N, XS, WS, BIAS, OS, stride_xs, c_desc, c_smem, res_bar, res_phase,
        X_SCALED: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
        GELU: gl.constexpr, QUANT_OUT: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, layout: gl.constexpr,
    ):  # fmt: skip
        offs_m = om + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = on + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        mask_m = offs_m < M
        mask_n = offs_n < N
        if X_SCALED:
            xs = gl.load(XS + offs_m.to(gl.int64) * stride_xs, mask=mask_m, other=0.0)
        else:
            xs = None
        # the device functions of models/gemm_persistent.py's epilogue (Triton functions
        # compile in a Gluon kernel as they are): one arithmetic for both kernels
        y = dequantize_bias_gelu(acc, xs, WS, BIAS, offs_n, mask_n, X_SCALED, HAS_BIAS, GELU)
        if HAS_RES:  # the residual's tile, which TMA put in c_smem during the main loop
            mbarrier.wait(res_bar, res_phase)
            y = y + c_smem.load(layout).to(gl.float32)
        if QUANT_OUT:  # int8 by fixed per-column scales, OS holding their inverses
            out = quantize_fixed(y, gl.load(OS + offs_n, mask=mask_n, other=0.0))
        else:
            out = y.to(c_desc.dtype)
        if not HAS_RES:
            tma.store_wait(0)  # this group's previous tile has left c_smem
        c_smem.store(out)
        fence_async_shared()
        tma_store(c_desc, [om, on], c_smem)  # past the end: clipped

    @gluon.jit
    def _ws_consumer(
        a_bufs, b_bufs, ready, empty, my_turn, their_turn, c_desc, r_desc, c_smem, res_bar,
        XS, WS, BIAS, OS, M, N, K, stride_xs, num_programs, CONSUMER: gl.constexpr,
        X_SCALED: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
        GELU: gl.constexpr, IS_FP8: gl.constexpr, QUANT_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, COOP: gl.constexpr,
    ):  # fmt: skip
        # wgmma's accumulator layout for one warp group; K of an instruction is 32 bytes
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        # a tile's columns: this group's half of a shared tile (COOP), or all of its own
        TILE_N: gl.constexpr = 2 * BLOCK_N if COOP else BLOCK_N
        start = gl.program_id(0)
        num_pid_m, num_pid_n, num_tiles, k_tiles = _ws_grid(M, N, K, BLOCK_M, TILE_N, BLOCK_K)
        # this group's tiles: every other one of the program's (each of them, COOP), whose
        # ring slots follow from the tile's place in the program's order (the producer's
        # `step`)
        local = 0
        first = start if COOP else start + CONSUMER * num_programs
        for tile_id in range(first, num_tiles, num_programs if COOP else 2 * num_programs):
            base = ((tile_id - start) // num_programs) * k_tiles
            pid_m, pid_n = _ws_tile(tile_id, GROUP_M * num_pid_n, num_pid_m, GROUP_M)
            om = pid_m * BLOCK_M
            on = pid_n * TILE_N + CONSUMER * BLOCK_N if COOP else pid_n * BLOCK_N
            if HAS_RES:  # the residual comes in by TMA under the main loop, into c_smem
                tma.store_wait(0)
                mbarrier.expect(res_bar, r_desc.block_type.nbytes)
                tma_load(r_desc, [om, on], res_bar, c_smem)
            if IS_FP8:
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=layout)
            else:
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, layout=layout)
            # the main loops take turns (the tiles' order in the program): a ring slot's
            # ready barrier is waited on by phase parity, which tells phase k from phase
            # k - 2 only once phase k - 1 is complete, and phase k - 1 is the other
            # group's previous tile. The first tile's turn (consumer 0, parity 1) is free.
            # COOP: both groups read every slot, which is emptied when both have arrived
            if not COOP:
                mbarrier.wait(my_turn, (local + 1 - CONSUMER) & 1)
            for ki in range(k_tiles):
                step = base + ki
                s = step % STAGES
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                b = b_bufs.index(s)
                if COOP:
                    b = b.slice(CONSUMER * BLOCK_N, BLOCK_N)
                acc = warpgroup_mma(a_bufs.index(s), b.permute((1, 0)), acc,
                                    use_acc=ki > 0, is_async=True)  # fmt: skip
                # one product in flight: the one before it is done, so is its slot
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
            if not COOP:
                # every slot of this tile waited on: the other group's main loop may start,
                # on the tensor cores behind this one's last products
                mbarrier.arrive(their_turn)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
            _ws_epilogue(acc, om, on, M, N, XS, WS, BIAS, OS,
                         stride_xs, c_desc, c_smem, res_bar, local & 1, X_SCALED, HAS_BIAS,
                         HAS_RES, GELU, QUANT_OUT, BLOCK_M, BLOCK_N, layout)  # fmt: skip
            local += 1
        tma.store_wait(0)

    @gluon.jit
    def ws_gemm(
        a_desc, b_desc, c_desc, r_desc, XS, WS, BIAS, OS, M, N, K, stride_xs,
        num_programs, X_SCALED: gl.constexpr, HAS_BIAS: gl.constexpr,
        HAS_RES: gl.constexpr, GELU: gl.constexpr, IS_FP8: gl.constexpr,
        QUANT_OUT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, COOP: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        TILE_N: gl.constexpr = b_desc.block_type.shape[0]  # 2 BLOCK_N where COOP
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)  # fmt: skip
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TILE_N, BLOCK_K],
                                           b_desc.layout)  # fmt: skip
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
        res_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2 if COOP else 1)
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(res_bars.index(i), count=1)
            mbarrier.init(turns.index(i), count=1)
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, ready, empty, turns.index(0), turns.index(1),
                            c_desc, r_desc, c_bufs.index(0), res_bars.index(0), XS, WS,
                            BIAS, OS, M, N, K, stride_xs, num_programs, 0,
                            X_SCALED, HAS_BIAS, HAS_RES, GELU, IS_FP8, QUANT_OUT, BLOCK_M,
                            BLOCK_N, BLOCK_K, GROUP_M, STAGES, COOP)),
            (_ws_consumer, (a_bufs, b_bufs, ready, empty, turns.index(1), turns.index(0),
                            c_desc, r_desc, c_bufs.index(1), res_bars.index(1), XS, WS,
                            BIAS, OS, M, N, K, stride_xs, num_programs, 1,
                            X_SCALED, HAS_BIAS, HAS_RES, GELU, IS_FP8, QUANT_OUT, BLOCK_M,
                            BLOCK_N, BLOCK_K, GROUP_M, STAGES, COOP)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                            num_programs, BLOCK_M, TILE_N, BLOCK_K, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip

    return ws_gemm


def served_config(
    residual: bool, gelu: bool, quant_out: bool, n: int, fp8: bool = False
) -> GluonConfig:
    """The launch shape of a product with this epilogue and `n` output columns:
    `COOP_PLAIN` for the plain int8 ones where `COOPERATIVE` and its 256-column tiles
    divide `n`, the ping-pong default for the rest (e4m3 operands too: the cooperative
    form has run on a GPU with int8 ones only)."""
    plain = not (residual or gelu or quant_out or fp8)
    if COOPERATIVE and plain and n % COOP_PLAIN.tile_n == 0:
        return COOP_PLAIN
    return GluonConfig()


def _layout(block: list[int], dtype: torch.dtype) -> Any:
    from triton.experimental.gluon import language as gl

    element = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
               torch.float16: gl.float16, torch.float32: gl.float32}[dtype]  # fmt: skip
    return gl.NVMMASharedLayout.get_default_for(block, element)


def launch_gluon(
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
    out_inv_scale: Tensor | None = None,
    config: GluonConfig | None = None,
) -> Tensor:
    """`xq [M, K]` int8 (or e4m3) x `weight [N, K]` -> `[M, N]`, as
    models.gemm_persistent.launch_persistent computes it; with `out_inv_scale [N]` the
    output leaves as int8 by those fixed per-column scales (as `launch_persistent_static_out`).
    Without `config`, `served_config` picks the launch shape. Raises ValueError where TMA
    cannot carry the operands."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from models.gemm_kernel import check_operands
    from models.gemm_persistent import _programs, persistent_supported

    M, K, N = check_operands(xq, weight)
    why = persistent_supported(xq, weight)
    if why is not None:
        raise ValueError(f"Gluon GEMM: {why}")
    if xq.device.type != "cuda":
        raise ValueError("the Gluon GEMM runs only on a CUDA device (Gluon has no interpreter)")
    quant_out = out_inv_scale is not None
    fp8 = xq.dtype == torch.float8_e4m3fn
    c = config or served_config(residual is not None, gelu, quant_out, N, fp8)
    if quant_out and (xq.dtype != torch.int8 or residual is not None):
        raise ValueError("a fixed-scale int8 output needs int8 operands and no residual")
    out = torch.empty(M, N, dtype=torch.int8 if quant_out else out_dtype, device=xq.device)
    if M == 0:
        return out
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    a_block, b_block, c_block = (
        [c.block_m, c.block_k],
        [c.tile_n, c.block_k],
        [c.block_m, c.block_n],
    )
    a_desc = TensorDescriptor.from_tensor(xq, a_block, _layout(a_block, xq.dtype))
    b_desc = TensorDescriptor.from_tensor(weight, b_block, _layout(b_block, weight.dtype))
    c_desc = TensorDescriptor.from_tensor(out, c_block, _layout(c_block, out.dtype))
    if residual is not None and residual.dtype != out.dtype:
        raise ValueError(f"the residual ({residual.dtype}) must have the output's dtype")
    r_desc = (
        c_desc
        if residual is None
        else TensorDescriptor.from_tensor(residual, c_block, _layout(c_block, residual.dtype))
    )
    w_scale = w_scale.float().contiguous()
    x_scaled = x_scale is not None
    xs = x_scale.float() if x_scale is not None and x_scale.dtype != torch.float32 else x_scale
    xs = w_scale if xs is None else xs  # a placeholder where the scales are in the weight
    tiles = -(-M // c.block_m) * -(-N // c.tile_n)
    # an SM each, two tiles at a time (one, COOP)
    programs = min(tiles if c.coop else -(-tiles // 2), _programs(xq.device))
    _kernel()[(programs,)](
        a_desc, b_desc, c_desc, r_desc, xs, w_scale,
        bias if bias is not None else w_scale,  # placeholders, never read
        out_inv_scale.float().contiguous() if quant_out else w_scale,  # type: ignore[union-attr]
        M, N, K, xs.stride(0), programs,
        X_SCALED=x_scaled, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        GELU=(2 if gelu_tanh else 1) if gelu else 0, IS_FP8=fp8,
        QUANT_OUT=quant_out, GROUP_M=8, STAGES=c.stages,
        CONSUMER_REGS=c.consumer_registers, PRODUCER_REGS=PRODUCER_REGISTERS, COOP=c.coop,
        num_warps=4, maxnreg=KERNEL_MAX_REGISTERS,
    )  # fmt: skip
    return out
