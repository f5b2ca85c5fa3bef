"""Flash attention with SAM's decomposed relative positions, as one Triton kernel.

Why a kernel of our own: the global blocks of the encoder attend over 4096 tokens, and the
decomposed bias `rel_h[q, y'] + rel_w[q, x']` written out is as large as the attention
matrix (400 MB per image in bf16). SDPA with that dense bias falls back to the
memory-efficient kernel and reads the bias from memory; FlexAttention gathers two bias
terms per score and measured 3.5x slower still on an H100 (docs/BENCHMARKS.md).

The layout makes the bias nearly free: keys are stored row-major on the `h x w` grid, so a
block of `w` consecutive keys is exactly one grid row y'. For a block of queries, the
`rel_w` term is then the same `[BLOCK_M, w]` tile for every key block (loaded once, kept in
registers), and the `rel_h` term is one column `rel_h[:, y']` per key block. The kernel is
an online-softmax loop over the `h` key rows, each iteration one `q @ k^T` and one `p @ v`.

Any grid: a key row of width w is loaded as a block of the next power of two (at least 16,
what `tl.dot` needs) with the extra keys masked out, so the 14x14 windows run as 14x16 and
the 64x64 global grid exactly. Any head dim, padded the same way (ViT-H's 80 runs as 128).
Forward only: this is an inference service.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from models.triton_device import triton_installed as triton_available

__all__ = [
    "MAX_GRID_W",
    "KernelConfig",
    "fused_rel_pos_attention",
    "fused_supported",
    "triton_available",
]


def fused_supported(grid: tuple[int, int], device: torch.device) -> bool:
    """Whether the kernel can run this grid here: CUDA, Triton installed, a row of keys
    that fits one block (the kernel keeps a `[BLOCK_M, w]` tile in registers)."""
    return triton_available() and device.type == "cuda" and 0 < grid[1] <= MAX_GRID_W


MAX_GRID_W = 128


class KernelConfig:
    """Launch shape. On an H100 (torch 2.11, triton 3.6; bench/sam_encoder.py --flex-kernel)
    a ViT-B global layer at batch 8 took 1.31 ms with 64/4/3, 1.44 with 64/4/2, 1.56 with
    128/4/2, 1.71 with 128/8/3 and 2.14 with 128/8/2 (docs/BENCHMARKS.md)."""

    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def rel_pos_flash_fwd(
        Q, K, V, RH, RW, O,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_hb, stride_hh, stride_hn,
        stride_wb, stride_wh, stride_wn,
        stride_ob, stride_oh, stride_on,
        heads, n_ctx, head_dim, grid_w, qk_scale,
        GRID_H: tl.constexpr, BLOCK_W: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        LOG2E: tl.constexpr = 1.4426950408889634
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // heads
        h = pid_bh % heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_w = tl.arange(0, BLOCK_W)
        mask_m = offs_m < n_ctx
        mask_d = offs_d < head_dim
        mask_w = offs_w < grid_w  # keys past the row's width: -inf, so they weigh nothing

        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        # rel_w[q, x'] for x' = 0..w-1: the same for every key row, so loaded once.
        rw_ptrs = RW + b * stride_wb + h * stride_wh + offs_m[:, None] * stride_wn + offs_w[None, :]
        rw = tl.load(rw_ptrs, mask=mask_m[:, None] & mask_w[None, :], other=0.0)
        rw = tl.where(mask_w[None, :], rw.to(tl.float32) * LOG2E, float("-inf"))
        rh_ptrs = RH + b * stride_hb + h * stride_hh + offs_m * stride_hn
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for row in range(GRID_H):  # key block = grid row y' = row
            offs_n = row * grid_w + offs_w
            k = tl.load(
                k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=mask_w[:, None] & mask_d[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units: scale * log2(e) folded in
            rh = tl.load(rh_ptrs + row, mask=mask_m, other=0.0).to(tl.float32) * LOG2E
            s = s + rh[:, None] + rw
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=mask_w[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])

    return rel_pos_flash_fwd


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch(
    q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor, out: Tensor | None = None
) -> Tensor:
    """Run the kernel: q, k, v `[B, heads, h*w, C]` (any strides with a contiguous last
    dim), rel_h `[B, heads, h*w, h]`, rel_w `[B, heads, h*w, w]` -> `[B, heads, h*w, C]`,
    written into `out` (which may be a strided view) when given.

    The bare launch under the op below, which is how model code reaches the kernel (an
    opaque op is what torch.compile and CUDA graphs need). Not exported: called directly
    only by the kernel's test and bench/sam_encoder.py, to sweep `KernelConfig`.
    """
    import triton

    q, k, v, rel_h, rel_w = (_last_dim_contiguous(t) for t in (q, k, v, rel_h, rel_w))
    B, heads, n_ctx, head_dim = q.shape
    grid_h, grid_w = rel_h.shape[-1], rel_w.shape[-1]
    if grid_h * grid_w != n_ctx:
        raise ValueError(f"{n_ctx} tokens do not make a {grid_h}x{grid_w} grid")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_m = KernelConfig.block_m
    launch_grid = (triton.cdiv(n_ctx, block_m), B * heads)
    _kernel()[launch_grid](
        q, k, v, rel_h, rel_w, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        rel_h.stride(0), rel_h.stride(1), rel_h.stride(2),
        rel_w.stride(0), rel_w.stride(1), rel_w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, n_ctx, head_dim, grid_w, head_dim**-0.5 * 1.4426950408889634,
        GRID_H=grid_h, BLOCK_W=max(16, triton.next_power_of_2(grid_w)),
        HEAD_DIM=triton.next_power_of_2(max(head_dim, 16)), BLOCK_M=block_m,
        num_warps=KernelConfig.num_warps, num_stages=KernelConfig.num_stages,
    )  # fmt: skip
    return out


@torch.library.custom_op("sam_serve::rel_pos_flash", mutates_args=())
def fused_rel_pos_attention(qkv: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(C) + rel_h[.., y'] + rel_w[.., x']) v without the dense bias.

    qkv `[B, N, 3, heads, C]` (the qkv projection, reshaped) -> `[B, N, heads * C]`: q, k
    and v are read in place and the output is written token-major, ready for the output
    projection. An opaque op to torch.compile (the kernel is already fused), captured by
    CUDA graphs.
    """
    B, N, _, heads, C = qkv.shape
    out = torch.empty(B, N, heads, C, dtype=qkv.dtype, device=qkv.device)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # views, each [B, heads, N, C]
    launch(q, k, v, rel_h, rel_w, out=out.transpose(1, 2))
    return out.reshape(B, N, heads * C)


@fused_rel_pos_attention.register_fake
def _(qkv: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    B, N, _, heads, C = qkv.shape
    return qkv.new_empty(B, N, heads * C)
