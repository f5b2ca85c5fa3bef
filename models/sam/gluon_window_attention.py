"""SAM's windowed attention (14 x 14 windows, decomposed relative positions, heads of 64) as
a warp-specialised Hopper kernel in Gluon: a producer warp loads each window's queries,
keys and values by TMA as the 16 x 16 box of tokens at its corner, two consumer warp groups
take a window's 196 queries in tiles of 64 against all of its keys at once.

Why: the Triton kernel (models/sam/fused_attention.py) runs a window as 14 key rows of 16
slots, an online softmax per row: a `[64, 16]` product, the row's maximum, sum and the
accumulator's rescale for every 16 keys. A windowed layer of ViT-B at batch 8 took
0.30-0.32 ms on an H200 (docs/BENCHMARKS.md, issue 20, thirteenth session), about 75
TFLOP/s, with eight such layers in the encoder. Here a window's keys are 256 slots in two
products of 128, so the softmax rescales once a tile rather than fourteen times, and the
decomposed bias comes with the scores from the tensor cores: the queries' product with the
keys is extended by 32 columns,

    [q, rel_h(q, 0..13) / s, rel_w(q, 0..13) / s, q . b_k (padding, 3), -30000]
  . [k, onehot(ky),          onehot(kx),          padded (3),            outside]

where `s` is the softmax's scale (applied to the whole score with log2(e) in the
exponent), the key slots' one-hot rows, columns and flags are one constant tile, and
`-30000` removes the box's slots outside the window (its 15th and 16th rows and columns,
the neighbours' tokens). The queries' `rel_h` and `rel_w` are gathered in registers from
their products with the head's two tables (`[32, 64]` each: Rh or Rw, then b_k).

Meta's encoder pads the grid to a multiple of the window before the qkv projection, so a
window past the image's edge holds tokens whose key and value are qkv's bias. TMA fills
the box past the image with zeros; the scores then get `q . b_k` by the flag columns (right
edge, bottom edge, less the corner counted twice), and the output gets the padded keys'
share of `p` times `b_v`, as the Triton kernel does; that share is taken from the terms
alone (a padded key's score is q . b_k + rel_h[ky] + rel_w[kx], so the sum of its
exponentials over a region factors into a sum over ky times one over kx), with no mask a
key in registers.

Measured on an H100 (2026-12-07, batch 8): 0.173-0.177 ms a windowed layer against the
Triton kernel's 0.271-0.274, the same output within bf16's rounding; the int8 encoder
531.7 img/s against 508.5 with the Triton kernel. The products' shared-memory descriptors
(about 36 64-bit values) are made from an opaque copy of the buffer index each tile
(`_win_here`): hoisted out of the tile loop, ptxas kept them in local memory (352 bytes of
stack) and the layer took 0.242 ms (docs/BENCHMARKS.md, issue 20, twenty-third and
twenty-fourth sessions).

Forward only, bf16 or fp16, windows of 14 and heads of 64 (ViT-B/L/H's windowed blocks);
Gluon has no interpreter: the CPU tests compile it for sm_90
(tests/models/test_gluon_window_attention.py), bench/gluon_window_attention.py checks it
against the Triton kernel and fp32 on the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from models.gemm_gluon import KERNEL_MAX_REGISTERS, PRODUCER_REGISTERS
from models.sam.gluon_attention import HEAD_DIM, qkv_problem, shared_layout

__all__ = [
    "WINDOW",
    "gluon_window_supported",
    "launch_gluon_window_attention",
    "window_constants",
    "window_tables",
]

WINDOW = 14
BOX = 16  # a window loads as the 16 x 16 box of tokens at its corner
KEYS = BOX * BOX  # a window's key slots, 196 of them its own
EXTRA = 16  # the scores' extra columns for each table: its 14 terms, then 2 flags
TABLE = 32  # a table's rows: Rh's or Rw's 27, then the head's b_k
BK_ROW = 2 * WINDOW - 1
CONSUMER_REGISTERS = 232
LOG2E = 1.4426950408889634

gl: Any = None  # set by `_kernel`: Triton resolves a kernel's names among module globals
mbarrier: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
tma_load: Any = None
NEW_API: Any = None
_win_job: Any = None
_win_here: Any = None
_win_exp_terms: Any = None
_win_producer: Any = None
_win_consumer: Any = None
quantize_fixed: Any = None


@functools.cache
def _kernel() -> Any:
    """Built on first use: importing this module never needs Triton."""
    global gl, mbarrier, warpgroup_mma, warpgroup_mma_wait, tma_load, NEW_API
    global _win_job, _win_here, _win_exp_terms, _win_producer, _win_consumer, quantize_fixed
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from models.gemm_gluon import tma_copies

    tma_load, _ = tma_copies(tma)
    NEW_API = gl.constexpr(hasattr(tma, "async_load"))
    from models.triton_quant import quantize_fixed

    @gluon.jit
    def _win_job(job, n_win, windows_w, heads):
        # jobs run window by window, each window's heads in turn (its box stays in L2)
        h = job % heads
        bw = job // heads
        win = bw % n_win
        return bw // n_win, win // windows_w, win % windows_w, h

    @gluon.jit
    def _win_here(x, i):
        # x, through an instruction the compiler cannot see into, tied to the tile i: the
        # shared-memory descriptors built from it stay next to their products in the tile
        # loop. Hoisted out of it (they depend only on the job's buffer), about 36 of them
        # lived across both tiles and ptxas spilled them.
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x, i], dtype=gl.int32,
                                         is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _win_producer(
        qkv_desc, t_desc, c_desc, q_smem, k_bufs, v_bufs, t_bufs, c_smem, const_ready,
        q_ready, q_empty, kv_ready, kv_empty, n_jobs, n_win, windows_w, heads, num_programs,
        WINDOW_: gl.constexpr, NEW_NAMES: gl.constexpr,
    ):  # fmt: skip
        box_layout: gl.constexpr = qkv_desc.layout
        box_shape: gl.constexpr = qkv_desc.block_type.shape
        head_dim: gl.constexpr = box_shape[3]
        box_bytes: gl.constexpr = qkv_desc.block_type.nbytes
        mbarrier.expect(const_ready, 2 * c_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma_load(c_desc, [i * c_desc.block_type.shape[0], 0], const_ready, c_smem.index(i))
        if NEW_NAMES:
            q_box = q_smem.reinterpret(q_smem.dtype, box_shape, box_layout)
        else:
            q_box = q_smem._reinterpret(q_smem.dtype, box_shape, box_layout)
        local = 0
        for job in range(gl.program_id(0), n_jobs, num_programs):
            b, wy, wx, h = _win_job(job, n_win, windows_w, heads)
            y0 = wy * WINDOW_
            x0 = wx * WINDOW_
            buf = local % 2
            mbarrier.wait(kv_empty.index(buf), ((local // 2) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(buf), 2 * box_bytes + 2 * t_desc.block_type.nbytes)
            if NEW_NAMES:
                k_box = k_bufs.index(buf).reinterpret(q_smem.dtype, box_shape, box_layout)
                v_box = v_bufs.index(buf).reinterpret(q_smem.dtype, box_shape, box_layout)
            else:
                k_box = k_bufs.index(buf)._reinterpret(q_smem.dtype, box_shape, box_layout)
                v_box = v_bufs.index(buf)._reinterpret(q_smem.dtype, box_shape, box_layout)
            tma_load(qkv_desc, [b, y0, x0, (heads + h) * head_dim], kv_ready.index(buf), k_box)
            tma_load(qkv_desc, [b, y0, x0, (2 * heads + h) * head_dim], kv_ready.index(buf),
                     v_box)  # fmt: skip
            for i in gl.static_range(2):  # the head's two tables
                tma_load(t_desc, [(2 * h + i) * t_desc.block_type.shape[0], 0],
                         kv_ready.index(buf), t_bufs.index(2 * buf + i))  # fmt: skip
            # the queries: one buffer, free once both consumers' products have read it
            mbarrier.wait(q_empty, (local & 1) ^ 1)
            mbarrier.expect(q_ready, box_bytes)
            tma_load(qkv_desc, [b, y0, x0, h * head_dim], q_ready, q_box)
            local += 1

    @gluon.jit
    def _win_exp_terms(x, j, QK_SCALE: gl.constexpr, WINDOW_: gl.constexpr):
        # exp2 of a table's 14 terms as the scores carry them (in bf16, times the scale),
        # less their maximum, and that maximum
        e = gl.where(j < WINDOW_, x.to(gl.float32) * QK_SCALE, float("-inf"))
        top = gl.max(e, 1)
        return gl.exp2(e - gl.expand_dims(top, 1)), top

    @gluon.jit
    def _win_consumer(
        q_smem, k_bufs, v_bufs, t_bufs, c_smem, const_ready, q_ready, q_empty, kv_ready,
        kv_empty, out_ptr, bias_v_ptr, out_inv_ptr, n_jobs, n_win, windows_w, heads, height,
        width, pad_x, pad_y, num_programs, CONSUMER: gl.constexpr, WINDOW_: gl.constexpr,
        BOX_: gl.constexpr, QK_SCALE: gl.constexpr, REL_SCALE: gl.constexpr,
        HAS_BIAS: gl.constexpr, OUTSIDE: gl.constexpr, QUANT_OUT: gl.constexpr,
    ):  # fmt: skip
        M: gl.constexpr = q_smem.shape[1]  # 64 queries a tile
        head_dim: gl.constexpr = q_smem.shape[2]
        half: gl.constexpr = k_bufs.shape[1] // 2  # key slots a product
        extra: gl.constexpr = c_smem.shape[2]  # 16 columns for each table's terms
        bk_row: gl.constexpr = 2 * WINDOW_ - 1
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, half, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, head_dim, 16]
        )
        e_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, extra, 16]
        )
        t_rows: gl.constexpr = t_bufs.shape[1]
        u_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, t_rows, 16]
        )
        x_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows = gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, head_dim, layout=gl.SliceLayout(0, o_layout))
        e_rows = gl.expand_dims(gl.arange(0, M, layout=gl.SliceLayout(1, e_layout)), 1)
        j = gl.expand_dims(gl.arange(0, extra, layout=gl.SliceLayout(0, e_layout)), 0)
        zero_s = gl.zeros((M, half), gl.float32, layout=s_layout)
        zero_o = gl.zeros((M, head_dim), gl.float32, layout=o_layout)
        zero_e = gl.zeros((M, t_rows), gl.float32, layout=u_layout)
        mbarrier.wait(const_ready, 0)
        local = 0
        for job in range(gl.program_id(0), n_jobs, num_programs):
            b, wy, wx, h = _win_job(job, n_win, windows_w, heads)
            buf = local % 2
            right = wx * WINDOW_ + WINDOW_ > width  # padded columns past the image
            bottom = wy * WINDOW_ + WINDOW_ > height
            rows_here = gl.minimum(height - wy * WINDOW_, WINDOW_)  # the window's real rows
            f_r = right.to(gl.float32)
            f_b = bottom.to(gl.float32)
            mbarrier.wait(kv_ready.index(buf), (local // 2) & 1)
            mbarrier.wait(q_ready, local & 1)
            for i in range(2):
                t = CONSUMER + 2 * i  # this group's query tiles: 4 rows of the box each
                # a tile of only padded queries (the bottom windows' last rows) is skipped
                if t * (M // BOX_) < rows_here:
                    a_q = q_smem.index(t)
                    here = _win_here(buf, i)
                    k_all = k_bufs.index(here)
                    v_all = v_bufs.index(here)
                    c_h = c_smem.index(here - buf)
                    c_w = c_smem.index(here - buf + 1)
                    # the queries against the head's tables (each [32, 64]: Rh or Rw, then b_k)
                    u_h = warpgroup_mma(a_q, t_bufs.index(2 * here).permute((1, 0)), zero_e,
                                        use_acc=False)  # fmt: skip
                    u_w = warpgroup_mma(a_q, t_bufs.index(2 * here + 1).permute((1, 0)), zero_e,
                                        use_acc=False)  # fmt: skip
                    r = t * M + e_rows
                    # rel_h[q, ky] = q . Rh[qy - ky + 13]; then q . b_k for the right and
                    # bottom edges' padded keys
                    idx_h = gl.where(j < WINDOW_, r // BOX_ - j + (WINDOW_ - 1), bk_row)
                    fac_h = gl.where(j < WINDOW_, REL_SCALE, gl.where(j == WINDOW_, f_r, f_b))
                    v_h = gl.gather(u_h, idx_h, 1)
                    x_h = (v_h * fac_h).to(dtype)
                    # rel_w[q, kx] = q . Rw[qx - kx + 13]; then q . b_k off again for the corner's
                    # padded keys (counted by both edges); then the slots outside the window
                    idx_w = gl.where(j < WINDOW_, r % BOX_ - j + (WINDOW_ - 1), bk_row)
                    corner = gl.where(j == WINDOW_, -f_r * f_b, 0.0)
                    fac_w = gl.where(j < WINDOW_, REL_SCALE, corner)
                    big = gl.where(j == WINDOW_ + 1, OUTSIDE, 0.0)
                    x_w = (gl.gather(u_w, idx_w, 1) * fac_w + big).to(dtype)
                    if HAS_BIAS:
                        # The padded keys' share of p (for b_v) from the terms alone: a padded
                        # key's score is q . b_k + rel_h[ky] + rel_w[kx] (its key loads as
                        # zeros), so its exponentials over a region ky >= pad_y or kx >= pad_x
                        # factor into a sum over ky times a sum over kx, taken here from the
                        # same rounded terms the scores get; scaled by the final maximum at
                        # the end. No per-key mask in registers.
                        eh, a_h = _win_exp_terms(x_h, j, QK_SCALE, WINDOW_)
                        ew, a_w = _win_exp_terms(x_w, j, QK_SCALE, WINDOW_)
                        h_all = gl.sum(eh, 1)
                        h_pad = gl.sum(gl.where(j >= pad_y, eh, 0.0), 1)
                        w_all = gl.sum(ew, 1)
                        w_pad = gl.sum(gl.where(j >= pad_x, ew, 0.0), 1)
                        qbk = gl.sum(gl.where(j == WINDOW_, v_h.to(dtype).to(gl.float32), 0.0), 1)
                        pad_sum = f_r * h_all * w_pad + f_b * h_pad * w_all \
                            - f_r * f_b * h_pad * w_pad  # fmt: skip
                        pad_log = qbk * QK_SCALE + a_h + a_w  # the region's exponent less the max
                    x_h = gl.convert_layout(x_h, x_op)
                    x_w = gl.convert_layout(x_w, x_op)
                    # the first half of the key slots' scores (the bias columns behind)
                    s = warpgroup_mma(a_q, k_all.slice(0, half).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)  # fmt: skip
                    s = warpgroup_mma(x_h, c_h.slice(0, half).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(x_w, c_w.slice(0, half).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(0, deps=(s,))
                    m0 = gl.max(s, 1) * QK_SCALE
                    p = gl.exp2(s * QK_SCALE - gl.expand_dims(m0, 1))
                    l_i = gl.sum(p, 1)
                    p_a = gl.convert_layout(p.to(q_smem.dtype), p_op)
                    # the second half's scores, then the first half's p . v behind them: the
                    # tensor cores run p . v while the second softmax runs
                    s = warpgroup_mma(q_smem.index(_win_here(t, i)),
                                      k_all.slice(half, half).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)  # fmt: skip
                    s = warpgroup_mma(x_h, c_h.slice(half, half).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(x_w, c_w.slice(half, half).permute((1, 0)), s, is_async=True)
                    acc = warpgroup_mma(p_a, v_all.slice(0, half), zero_o, use_acc=False,
                                        is_async=True)  # fmt: skip
                    s = warpgroup_mma_wait(1, deps=(s,))
                    if i == 1:
                        mbarrier.arrive(q_empty)  # this group has read its queries
                    m1 = gl.maximum(m0, gl.max(s, 1) * QK_SCALE)
                    alpha = gl.exp2(m0 - m1)
                    p = gl.exp2(s * QK_SCALE - gl.expand_dims(m1, 1))
                    l_i = l_i * alpha + gl.sum(p, 1)
                    p_b = gl.convert_layout(p.to(q_smem.dtype), p_op)
                    acc, p_a = warpgroup_mma_wait(0, deps=(acc, p_a))
                    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
                    acc = acc * gl.expand_dims(alpha_o, 1)
                    acc = warpgroup_mma(p_b, v_all.slice(half, half), acc)
                    if i == 1:
                        mbarrier.arrive(kv_empty.index(buf))  # keys, values, tables used
                    if HAS_BIAS:
                        bv = gl.load(bias_v_ptr + h * head_dim + o_cols).to(gl.float32)
                        m_e = gl.convert_layout(m1, pad_log.type.layout)
                        pad_p = pad_sum * gl.exp2(pad_log - m_e)
                        pad_o = gl.convert_layout(pad_p, gl.SliceLayout(1, o_layout))
                        acc = acc + gl.expand_dims(pad_o, 1) * gl.expand_dims(bv, 0)
                    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
                    out = acc / gl.expand_dims(l_o, 1)
                    ro = t * M + o_rows
                    qy_o = ro // BOX_
                    qx_o = ro % BOX_
                    y = wy * WINDOW_ + qy_o
                    x_ = wx * WINDOW_ + qx_o
                    keep = (qy_o < WINDOW_) & (qx_o < WINDOW_) & (y < height) & (x_ < width)
                    token = (b * height + y) * width + x_
                    ptrs = out_ptr + gl.expand_dims(token * (heads * head_dim) + h * head_dim, 1) \
                        + gl.expand_dims(o_cols, 0)  # fmt: skip
                    if QUANT_OUT:  # int8 for the projection, by its fixed input scales
                        inv = gl.load(out_inv_ptr + h * head_dim + o_cols)
                        gl.store(ptrs, quantize_fixed(out, inv), mask=gl.expand_dims(keep, 1))
                    else:
                        gl.store(ptrs, out.to(q_smem.dtype), mask=gl.expand_dims(keep, 1))
                elif i == 1:
                    mbarrier.arrive(q_empty)
                    mbarrier.arrive(kv_empty.index(buf))
            local += 1

    @gluon.jit
    def rel_pos_window_attention_ws(
        qkv_desc, t_desc, c_desc, out_ptr, bias_v_ptr, out_inv_ptr, n_jobs, n_win, windows_w,
        heads, height, width, pad_x, pad_y, num_programs,
        WINDOW_: gl.constexpr, BOX_: gl.constexpr, QK_SCALE: gl.constexpr,
        REL_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, OUTSIDE: gl.constexpr,
        QUANT_OUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):  # fmt: skip
        NEW_NAMES: gl.constexpr = NEW_API
        dtype: gl.constexpr = qkv_desc.dtype
        head_dim: gl.constexpr = qkv_desc.block_type.shape[3]
        keys: gl.constexpr = BOX_ * BOX_
        M: gl.constexpr = 64
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, head_dim], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [keys // M, M, head_dim], tile_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2, keys, head_dim], tile_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2, keys, head_dim], tile_layout)
        t_rows: gl.constexpr = t_desc.block_type.shape[0]
        t_bufs = gl.allocate_shared_memory(dtype, [4, t_rows, head_dim], t_desc.layout)
        c_rows: gl.constexpr = c_desc.block_type.shape[0]
        c_cols: gl.constexpr = c_desc.block_type.shape[1]
        c_smem = gl.allocate_shared_memory(dtype, [2, c_rows, c_cols], c_desc.layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        singles = gl.allocate_shared_memory(gl.int64, [3, 1], bar_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        const_ready = singles.index(0)
        q_ready = singles.index(1)
        q_empty = singles.index(2)
        mbarrier.init(const_ready, count=1)
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)  # both consumers read every job's queries
        for i in gl.static_range(2):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        gl.warp_specialize([
            (_win_consumer, (q_smem, k_bufs, v_bufs, t_bufs, c_smem, const_ready, q_ready,
                             q_empty, kv_ready, kv_empty, out_ptr, bias_v_ptr, out_inv_ptr,
                             n_jobs, n_win, windows_w, heads, height, width, pad_x, pad_y,
                             num_programs, 0, WINDOW_, BOX_, QK_SCALE, REL_SCALE, HAS_BIAS,
                             OUTSIDE, QUANT_OUT)),
            (_win_consumer, (q_smem, k_bufs, v_bufs, t_bufs, c_smem, const_ready, q_ready,
                             q_empty, kv_ready, kv_empty, out_ptr, bias_v_ptr, out_inv_ptr,
                             n_jobs, n_win, windows_w, heads, height, width, pad_x, pad_y,
                             num_programs, 1, WINDOW_, BOX_, QK_SCALE, REL_SCALE, HAS_BIAS,
                             OUTSIDE, QUANT_OUT)),
            (_win_producer, (qkv_desc, t_desc, c_desc, q_smem, k_bufs, v_bufs, t_bufs, c_smem,
                             const_ready, q_ready, q_empty, kv_ready, kv_empty, n_jobs, n_win,
                             windows_w, heads, num_programs, WINDOW_, NEW_NAMES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip

    return rel_pos_window_attention_ws


def gluon_window_supported(
    qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, height: int, width: int
) -> str | None:
    """None where this kernel can run the windowed layer, else why not (for the caller's
    fallback)."""
    if rel_pos_h.shape[0] != 2 * WINDOW - 1 or rel_pos_w.shape[0] != 2 * WINDOW - 1:
        return f"windows of {WINDOW} only"
    if qkv.dim() == 5 and qkv.shape[1] != height * width:
        return f"{qkv.shape[1]} tokens are not a {height} x {width} grid"
    return qkv_problem(qkv)


def window_tables(
    rel_pos_h: Tensor, rel_pos_w: Tensor, bias_k: Tensor | None, heads: int, dtype: torch.dtype
) -> Tensor:
    """Two `[32, 64]` tables a head, stacked `[heads * 64, 64]`: Rh's 27 rows then the
    head's b_k, and Rw's 27 rows then b_k; the queries' product with them gives rel_h (or
    rel_w) and q . b_k in one product each."""
    t = rel_pos_h.new_zeros(heads, 2, TABLE, HEAD_DIM, dtype=dtype)
    t[:, 0, : 2 * WINDOW - 1] = rel_pos_h.to(dtype)
    t[:, 1, : 2 * WINDOW - 1] = rel_pos_w.to(dtype)
    if bias_k is not None:
        t[:, :, BK_ROW] = bias_k.view(heads, 1, HEAD_DIM).to(dtype)
    return t.view(heads * 2 * TABLE, HEAD_DIM)


# A layer's tables by its parameters (their storage and version: an in-place update of the
# weights makes new ones): built once, not five small kernels every call of every layer.
_TABLES: dict[tuple[Any, ...], Tensor] = {}
_TABLES_KEPT = 64  # layers' tables held at most (ViT-H has 28 windowed layers)


def _layer_tables(
    rel_pos_h: Tensor, rel_pos_w: Tensor, bias_k: Tensor | None, heads: int, dtype: torch.dtype
) -> Tensor:
    parts = (rel_pos_h, rel_pos_w) if bias_k is None else (rel_pos_h, rel_pos_w, bias_k)
    key = (heads, dtype, *((t.data_ptr(), t._version, t.device) for t in parts))
    if (tables := _TABLES.get(key)) is None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.pop(next(iter(_TABLES)))
        tables = _TABLES[key] = window_tables(rel_pos_h, rel_pos_w, bias_k, heads, dtype)
    return tables


@functools.cache
def window_constants(pad_x: int, pad_y: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The key slots' side of the scores' extra columns, two `[256, 16]` tiles stacked:
    slot (ky, kx) of the 16 x 16 box has a one in the first's column ky and the second's
    column kx (inside the window); the first's columns 14 and 15 flag the slots Meta pads
    past the image in a window of the right edge (kx >= pad_x) and of the bottom edge (ky
    >= pad_y), the second's column 14 those of both and 15 the slots outside the window."""
    # built on the device by broadcasting alone (no copy from the host, no sync: a first
    # call may come while a CUDA graph is captured)
    slot = torch.arange(KEYS, device=device)
    ky, kx = (slot // BOX)[:, None], (slot % BOX)[:, None]
    j = torch.arange(EXTRA, device=device)[None, :]
    inside = (ky < WINDOW) & (kx < WINDOW)
    right, bottom = inside & (kx >= pad_x), inside & (ky >= pad_y)
    c_h = torch.where(j < WINDOW, inside & (ky == j), torch.where(j == WINDOW, right, bottom))
    c_w = torch.where(j < WINDOW, inside & (kx == j),
                      torch.where(j == WINDOW, right & bottom, ~inside))  # fmt: skip
    c = torch.stack((c_h, c_w))
    return c.view(2 * KEYS, EXTRA).to(dtype)


def launch_gluon_window_attention(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    qkv_bias: Tensor | None,
    height: int,
    width: int,
    out: Tensor | None = None,
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    """SAM's windowed attention on the qkv projection of the whole grid, as
    models.sam.fused_attention.fused_window_attention computes it: qkv `[B, height *
    width, 3, heads, 64]` -> `[B, height * width, heads * 64]` token-major, windows of 14
    padded past the grid's edge as Meta pads them (keys and values of `qkv_bias`). With
    `out_inv_scale [heads * 64]` (fp32) the output leaves int8 by those fixed per-channel
    scales (`models.triton_quant.quantize_fixed`), the output projection's input
    (`models.mlp_static`). Raises ValueError where the layer is not one this kernel runs
    (`gluon_window_supported`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from models.gemm_persistent import _programs

    why = gluon_window_supported(qkv, rel_pos_h, rel_pos_w, height, width)
    if why is not None:
        raise ValueError(why)
    B, N, _, heads, C = qkv.shape
    if out is None:
        kind = qkv.dtype if out_inv_scale is None else torch.int8
        out = qkv.new_empty(B, N, heads * C, dtype=kind)
    windows_h, windows_w = -(-height // WINDOW), -(-width // WINDOW)
    pad_x = width - (windows_w - 1) * WINDOW  # real columns of the last window column
    pad_y = height - (windows_h - 1) * WINDOW
    bias_k = bias_v = None
    if qkv_bias is not None:
        _, bias_k, bias_v = qkv_bias.view(3, heads * C)
    box = [1, BOX, BOX, C]
    qkv_desc = TensorDescriptor.from_tensor(qkv.view(B, height, width, 3 * heads * C), box,
                                            shared_layout(box, qkv.dtype))  # fmt: skip
    tables = _layer_tables(rel_pos_h, rel_pos_w, bias_k, heads, qkv.dtype)
    t_desc = TensorDescriptor.from_tensor(tables, [TABLE, C],
                                          shared_layout([TABLE, C], qkv.dtype))  # fmt: skip
    const = window_constants(pad_x, pad_y, qkv.device, qkv.dtype)
    c_desc = TensorDescriptor.from_tensor(const, [KEYS, EXTRA],
                                          shared_layout([KEYS, EXTRA], qkv.dtype))  # fmt: skip
    n_win = windows_h * windows_w
    n_jobs = B * n_win * heads
    programs = min(n_jobs, _programs(qkv.device))
    _kernel()[(programs,)](
        qkv_desc, t_desc, c_desc, out, bias_v if bias_v is not None else out,
        out_inv_scale if out_inv_scale is not None else out, n_jobs, n_win, windows_w, heads,
        height, width, pad_x, pad_y, programs,
        WINDOW_=WINDOW, BOX_=BOX, QK_SCALE=C**-0.5 * LOG2E, REL_SCALE=C**0.5,
        HAS_BIAS=qkv_bias is not None, OUTSIDE=-30000.0, QUANT_OUT=out_inv_scale is not None,
        CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS,
        num_warps=4, maxnreg=KERNEL_MAX_REGISTERS,
    )  # fmt: skip
    return out
