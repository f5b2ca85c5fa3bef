"""SAM's global attention (decomposed relative positions, a 64 x 64 grid, heads of 64) as a
warp-specialised Hopper kernel in Gluon: one producer warp loads by TMA, two consumer warp
groups of 64 queries each share every key and value tile it loads.

Why: the Triton kernel (models/sam/fused_attention.py) takes a global layer of ViT-B at
batch 8 in 1.27-1.31 ms where SDPA without any bias takes 0.92 (H100 and H200,
docs/BENCHMARKS.md, issue 20). Each of its programs holds 64 queries and loads every key
and value of its head itself, 1 MB a program and about 6.3 GB a layer from L2: about
5 TB/s at its speed, close to what Hopper's L2 gives. Here a CTA holds 128 queries (two
warp groups of one grid row each) and loads each tile once for both, so half the bytes
cross from L2, by TMA, which costs the consumers no instructions. Each consumer issues the
next key row's `q . k` before the softmax of the current one and the current row's `p . v`
behind it (FlashAttention-3's overlap inside a warp group), so the tensor cores have work
while the softmax's exponentials run (with heads of 64, the exponentials take as long on
the SFU as the two products on the tensor cores).

Measured on an H100 (2026-12-07, batch 8): 1.217 ms a layer against the Triton kernel's
1.262, the same output within bf16's rounding; SDPA without bias 0.917. Halving the bytes
from L2 was not what binds the layer (docs/BENCHMARKS.md, issue 20, twenty-second
session).

The arithmetic is the Triton kernel's: log2 units with the scale folded in, `rel_w[q, x']`
one `[64, 64]` tile for the whole loop (a grid row of keys is one block, so it is the same
every row), `rel_h[q, y']` one number a query a row riding on the row maximum. Both come
from the tables inside the kernel: `q . Rw^T` and `Rh . q^T` by the tensor cores, then
`rel_w` gathered along the diagonal in registers and `rel_h` kept, transposed, in shared
memory, one row of it read each key row.

Global blocks only (no windows, so no padding: every tile is whole); heads of 64 and a
64 x 64 grid (ViT-B/L/H at 1024 px: 4,096 tokens). Gluon has no interpreter: the CPU
tests compile it for sm_90 (tests/models/test_gluon_attention.py), bench/gluon_attention.py
checks it against the Triton kernel and times it on the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from models.gemm_gluon import KERNEL_MAX_REGISTERS, PRODUCER_REGISTERS

__all__ = ["GRID", "HEAD_DIM", "gluon_attention_supported", "launch_gluon_attention"]

GRID = 64  # the token grid's side: one key row a block, one query row a consumer
HEAD_DIM = 64
STAGES = 4  # key and value tiles in flight
CONSUMER_REGISTERS = 232  # with the producer's, what the GEMM's warp groups take too
LOG2E = 1.4426950408889634

gl: Any = None  # set by `_kernel`: Triton resolves a kernel's names among module globals
mbarrier: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
tma: Any = None
tma_load: Any = None
tma_store: Any = None
sync_group: Any = None
NEW_API: Any = None  # whether Triton has the later names (TMA copies, `reinterpret`): `_kernel`
_attn_producer: Any = None
_attn_consumer: Any = None
_attn_softmax: Any = None
_attn_tile: Any = None
quantize_fixed: Any = None


@functools.cache
def _kernel() -> Any:
    """Built on first use: importing this module never needs Triton."""
    global gl, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, tma
    global tma_load, tma_store, sync_group, _attn_producer, _attn_consumer, _attn_softmax
    global _attn_tile, quantize_fixed
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    global NEW_API
    from models.gemm_gluon import tma_copies

    tma_load, tma_store = tma_copies(tma)
    from models.triton_quant import quantize_fixed

    # the later names (`reinterpret`) come with TMA's; a kernel reads only constexpr globals
    NEW_API = gl.constexpr(hasattr(tma, "async_load"))
    # a barrier of the calling partition's threads (3.6: thread_barrier; later: barrier)
    sync_group = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

    @gluon.jit
    def _attn_tile(tile, q_tiles, heads):
        # a tile is two grid rows of queries of one image's head; tiles run head by head
        bh = tile // q_tiles
        return bh // heads, bh % heads, tile % q_tiles

    @gluon.jit
    def _attn_producer(
        qkv_desc, rh_desc, rw_desc, q_bufs, k_bufs, v_bufs, rh_smem, rw_smem, tables_ready,
        q_ready, q_empty, kv_ready, kv_empty, n_tiles, q_tiles, heads, num_programs,
        GRID_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        # the tables once; then each tile's two query rows and its 64 key and value rows,
        # the ring's slots in order across tiles
        mbarrier.expect(tables_ready, 2 * rh_desc.block_type.nbytes)
        tma_load(rh_desc, [0, 0], tables_ready, rh_smem)
        tma_load(rw_desc, [0, 0], tables_ready, rw_smem)
        tile_bytes: gl.constexpr = qkv_desc.block_type.nbytes
        head_dim: gl.constexpr = qkv_desc.block_type.shape[1]
        step = 0
        local = 0
        for tile in range(gl.program_id(0), n_tiles, num_programs):
            b, h, qt = _attn_tile(tile, q_tiles, heads)
            first = b * (GRID_N * GRID_N)  # the image's first token's row
            for c in gl.static_range(2):  # each consumer's query row, once it is done with
                mbarrier.wait(q_empty.index(c), (local & 1) ^ 1)  # the tile before's
                mbarrier.expect(q_ready.index(c), tile_bytes)
                q_row = first + (qt * 2 + c) * GRID_N
                tma_load(qkv_desc, [q_row, h * head_dim], q_ready.index(c), q_bufs.index(c))
            for y in range(GRID_N):
                s = step % STAGES
                mbarrier.wait(kv_empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(kv_ready.index(s), 2 * tile_bytes)
                k_row = first + y * GRID_N
                tma_load(qkv_desc, [k_row, (heads + h) * head_dim], kv_ready.index(s),
                         k_bufs.index(s))  # fmt: skip
                tma_load(qkv_desc, [k_row, (2 * heads + h) * head_dim], kv_ready.index(s),
                         v_bufs.index(s))  # fmt: skip
                step += 1
            local += 1

    @gluon.jit
    def _attn_softmax(qk, rw, rh, m_i, l_i, QK_SCALE: gl.constexpr):
        # log2 units; rel_h, one number a query this row, rides on the row maximum
        s = qk * QK_SCALE + rw
        m_new = gl.maximum(m_i, gl.max(s, 1) + rh)
        p = gl.exp2(s - gl.expand_dims(m_new - rh, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _attn_consumer(
        q_bufs, k_bufs, v_bufs, rh_smem, rw_smem, uh_smem, o_smem, tables_ready,
        q_ready, q_empty, kv_ready, kv_empty, o_desc, out_inv_ptr, n_tiles, q_tiles, heads,
        num_programs, CONSUMER: gl.constexpr, GRID_N: gl.constexpr, STAGES: gl.constexpr,
        QK_SCALE: gl.constexpr, NEW_NAMES: gl.constexpr, QUANT_OUT: gl.constexpr,
    ):  # fmt: skip
        LOG2E_: gl.constexpr = 1.4426950408889634
        head_dim: gl.constexpr = o_desc.block_type.shape[1]
        # wgmma's accumulators for one warp group: the scores and the output [64, 64], the
        # queries' products with Rw [64, 128] and Rh's with the queries [128, 64]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GRID_N, 16]
        )
        uw_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * GRID_N, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        # rel_w[i, x'] = uw[i, i - x' + GRID_N - 1]: query i of the row is column i
        rows = gl.expand_dims(gl.arange(0, GRID_N, layout=row_layout), 1)
        diag = rows - gl.expand_dims(gl.arange(0, GRID_N, layout=col_layout), 0) + (GRID_N - 1)
        zero_s = gl.zeros((GRID_N, GRID_N), gl.float32, layout=s_layout)
        q_smem = q_bufs.index(CONSUMER)
        # the same bytes as 128 rows of one dimension, so that a row can be indexed (the
        # layouts are plain row-major, without swizzling, so both views agree)
        row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        if NEW_NAMES:
            uh_rows = uh_smem.reinterpret(uh_smem.dtype, [2 * GRID_N, GRID_N], row_smem)
        else:
            uh_rows = uh_smem._reinterpret(uh_smem.dtype, [2 * GRID_N, GRID_N], row_smem)
        mbarrier.wait(tables_ready, 0)
        step = 0
        local = 0
        for tile in range(gl.program_id(0), n_tiles, num_programs):
            b, h, qt = _attn_tile(tile, q_tiles, heads)
            qy = qt * 2 + CONSUMER  # this group's grid row of queries
            mbarrier.wait(q_ready.index(CONSUMER), local & 1)
            uw = warpgroup_mma(q_smem, rw_smem.permute((1, 0)),
                               gl.zeros((GRID_N, 2 * GRID_N), gl.float32, layout=uw_layout),
                               use_acc=False)  # fmt: skip
            uh_t = warpgroup_mma(rh_smem, q_smem.permute((1, 0)),
                                 gl.zeros((2 * GRID_N, GRID_N), gl.float32, layout=s_layout),
                                 use_acc=False)  # fmt: skip
            q = q_smem.load(a_layout)
            mbarrier.arrive(q_empty.index(CONSUMER))  # the producer may load the next row
            rw = gl.gather(uw, diag, 1) * LOG2E_
            sync_group()  # the tile before has read all of uh_smem
            uh_smem.store(uh_t.to(uh_smem.dtype))
            sync_group()  # and every thread's part of it is there to read

            s0 = step % STAGES
            mbarrier.wait(kv_ready.index(s0), (step // STAGES) & 1)
            qk = warpgroup_mma(q, k_bufs.index(s0).permute((1, 0)), zero_s, use_acc=False)
            rh = uh_rows.index(qy + GRID_N - 1).load(row_layout).to(gl.float32) * LOG2E_
            m_i = gl.full((GRID_N,), float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.zeros((GRID_N,), gl.float32, layout=row_layout)
            p, m_i, l_i, alpha = _attn_softmax(qk, rw, rh, m_i, l_i, QK_SCALE)
            p_op = gl.convert_layout(p.to(q_smem.dtype), a_layout)
            acc = gl.zeros((GRID_N, head_dim), gl.float32, layout=s_layout)
            for y in range(1, GRID_N):
                st = step + y
                s = st % STAGES
                prev = (st - 1) % STAGES
                mbarrier.wait(kv_ready.index(s), (st // STAGES) & 1)
                # this row's q . k, then the row before's p . v behind it: the softmax
                # below runs while the second is on the tensor cores
                qk_t = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), zero_s,
                                     use_acc=False, is_async=True)  # fmt: skip
                pv_t = warpgroup_mma(p_op, v_bufs.index(prev), acc, use_acc=y > 1,
                                     is_async=True)  # fmt: skip
                rh = uh_rows.index(qy - y + GRID_N - 1).load(row_layout).to(gl.float32) * LOG2E_
                qk = warpgroup_mma_wait(1, deps=(qk_t,))
                p, m_i, l_i, alpha = _attn_softmax(qk, rw, rh, m_i, l_i, QK_SCALE)
                acc, p_op = warpgroup_mma_wait(0, deps=(pv_t, p_op))
                mbarrier.arrive(kv_empty.index(prev))  # the row before's k and v are used
                acc = acc * gl.expand_dims(alpha, 1)
                p_op = gl.convert_layout(p.to(q_smem.dtype), a_layout)
            last = (step + GRID_N - 1) % STAGES
            acc = warpgroup_mma(p_op, v_bufs.index(last), acc)
            mbarrier.arrive(kv_empty.index(last))
            step += GRID_N

            out = acc / gl.expand_dims(l_i, 1)
            tma.store_wait(0)  # this group's tile before has left o_smem
            if QUANT_OUT:  # int8 for the projection, by its fixed input scales
                cols = h * head_dim + gl.arange(0, head_dim, layout=col_layout)
                inv = gl.load(out_inv_ptr + cols)
                o_smem.store(quantize_fixed(out, inv))
            else:
                o_smem.store(out.to(o_smem.dtype))
            fence_async_shared()
            tma_store(o_desc, [b * (GRID_N * GRID_N) + qy * GRID_N, h * head_dim], o_smem)
            local += 1
        tma.store_wait(0)

    @gluon.jit
    def rel_pos_attention_ws(
        qkv_desc, rh_desc, rw_desc, o_desc, out_inv_ptr, n_tiles, q_tiles, heads, num_programs,
        GRID_N: gl.constexpr, STAGES: gl.constexpr, QK_SCALE: gl.constexpr,
        QUANT_OUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):  # fmt: skip
        NEW_NAMES: gl.constexpr = NEW_API
        dtype: gl.constexpr = qkv_desc.dtype
        tile_layout: gl.constexpr = qkv_desc.layout
        head_dim: gl.constexpr = qkv_desc.block_type.shape[1]
        q_bufs = gl.allocate_shared_memory(dtype, [2, GRID_N, head_dim], tile_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, GRID_N, head_dim], tile_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, GRID_N, head_dim], tile_layout)
        rh_smem = gl.allocate_shared_memory(dtype, [2 * GRID_N, head_dim], rh_desc.layout)
        rw_smem = gl.allocate_shared_memory(dtype, [2 * GRID_N, head_dim], rw_desc.layout)
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2, GRID_N, head_dim], o_desc.layout)
        # Rh . q^T of each consumer, a row of it read each key row (plain rows: a row is
        # read whole, by the scores' row layout)
        uh_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        uh_bufs = gl.allocate_shared_memory(dtype, [2, 2 * GRID_N, GRID_N], uh_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        tables = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # a consumer each
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        tables_ready = tables.index(0)
        mbarrier.init(tables_ready, count=1)
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers read every tile
        gl.warp_specialize([
            (_attn_consumer, (q_bufs, k_bufs, v_bufs, rh_smem, rw_smem, uh_bufs.index(0),
                              o_bufs.index(0), tables_ready, q_ready, q_empty, kv_ready,
                              kv_empty, o_desc, out_inv_ptr, n_tiles, q_tiles, heads,
                              num_programs, 0, GRID_N, STAGES, QK_SCALE, NEW_NAMES,
                              QUANT_OUT)),
            (_attn_consumer, (q_bufs, k_bufs, v_bufs, rh_smem, rw_smem, uh_bufs.index(1),
                              o_bufs.index(1), tables_ready, q_ready, q_empty, kv_ready,
                              kv_empty, o_desc, out_inv_ptr, n_tiles, q_tiles, heads,
                              num_programs, 1, GRID_N, STAGES, QK_SCALE, NEW_NAMES,
                              QUANT_OUT)),
            (_attn_producer, (qkv_desc, rh_desc, rw_desc, q_bufs, k_bufs, v_bufs, rh_smem,
                              rw_smem, tables_ready, q_ready, q_empty, kv_ready, kv_empty,
                              n_tiles, q_tiles, heads, num_programs, GRID_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip

    return rel_pos_attention_ws


def qkv_problem(qkv: Tensor) -> str | None:
    """Why the Gluon attention kernels cannot read this qkv projection (both take `[B, N, 3,
    heads, 64]`, bf16 or fp16, contiguous, on CUDA), or None."""
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[4] != HEAD_DIM:
        return f"qkv {tuple(qkv.shape)}: [B, N, 3, heads, {HEAD_DIM}] needed"
    if qkv.dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 only, not {qkv.dtype}"
    if not qkv.is_contiguous():
        return "qkv must be contiguous"
    if qkv.device.type != "cuda":
        return "the Gluon attention runs only on a CUDA device (Gluon has no interpreter)"
    return None


def gluon_attention_supported(qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor) -> str | None:
    """None where this kernel can run the layer, else why not (for the caller's fallback)."""
    if qkv.dim() == 5 and (qkv.shape[1] != GRID * GRID or rel_pos_h.shape[0] != 2 * GRID - 1
                           or rel_pos_w.shape[0] != 2 * GRID - 1):  # fmt: skip
        return f"a {GRID} x {GRID} grid only (a global block at 1024 px)"
    return qkv_problem(qkv)


def shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    """The TMA tile's shared-memory layout (128-byte swizzle where rows allow)."""
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int8: gl.int8}[dtype]
    return gl.NVMMASharedLayout.get_default_for(block, element)


def launch_gluon_attention(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    out: Tensor | None = None,
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(C) + rel_h + rel_w) v for qkv `[B, 4096, 3, heads, 64]` (the
    qkv projection, reshaped) -> `[B, 4096, heads * 64]` token-major, as
    models.sam.fused_attention.fused_rel_pos_attention computes it; with `out_inv_scale
    [heads * 64]` (fp32) int8 by those fixed per-channel scales, the output projection's
    input (`models.mlp_static`). Raises ValueError where the layer is not one this kernel
    runs (`gluon_attention_supported`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from models.gemm_persistent import _programs

    why = gluon_attention_supported(qkv, rel_pos_h, rel_pos_w)
    if why is not None:
        raise ValueError(why)
    B, N, _, heads, C = qkv.shape
    if out is None:
        kind = qkv.dtype if out_inv_scale is None else torch.int8
        out = qkv.new_empty(B, N, heads * C, dtype=kind)
    # the tables in the operands' type, their 127 rows read as 128 (TMA fills the last)
    rph = rel_pos_h.to(qkv.dtype).contiguous()
    rpw = rel_pos_w.to(qkv.dtype).contiguous()
    tile = [GRID, C]
    table = [2 * GRID, C]
    qkv_desc = TensorDescriptor.from_tensor(qkv.view(B * N, 3 * heads * C), tile,
                                            shared_layout(tile, qkv.dtype))  # fmt: skip
    rh_desc = TensorDescriptor.from_tensor(rph, table, shared_layout(table, qkv.dtype))
    rw_desc = TensorDescriptor.from_tensor(rpw, table, shared_layout(table, qkv.dtype))
    o_desc = TensorDescriptor.from_tensor(out.view(B * N, heads * C), tile,
                                          shared_layout(tile, out.dtype))  # fmt: skip
    q_tiles = GRID // 2  # two query rows a tile
    n_tiles = B * heads * q_tiles
    programs = min(n_tiles, _programs(qkv.device))
    _kernel()[(programs,)](
        qkv_desc, rh_desc, rw_desc, o_desc, out_inv_scale if out_inv_scale is not None else out,
        n_tiles, q_tiles, heads, programs,
        GRID_N=GRID, STAGES=STAGES, QK_SCALE=C**-0.5 * LOG2E, QUANT_OUT=out_inv_scale is not None,
        CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS,
        num_warps=4, maxnreg=KERNEL_MAX_REGISTERS,
    )  # fmt: skip
    return out
