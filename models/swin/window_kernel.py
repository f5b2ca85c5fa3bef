"""Swin's (shifted) window attention as one Triton kernel, on the token grid as it lies.

Why a kernel: written out, a Swin-T block rolls the normed grid, copies it into windows,
projects, copies q, k and v apart per head, multiplies `[49, 32]` by `[32, 49]` matrices
in batched GEMMs far too small for cuBLAS, writes the `[49, 49]` scores, adds the bias and
the shift mask, writes the softmax, reads it back for the second product, and copies the
windows back and rolls them again. At batch 256 the score tensors alone are about 4.5 GB
of memory traffic a batch.

Here a program takes one window of one head of one image: it reads the window's queries,
keys and values straight out of the qkv projection of the *unrolled* grid (the cyclic
shift is only an address: a token of the rolled grid at (r, c) is the grid's token at
((r + shift) mod H, (c + shift) mod W)), builds the relative position bias from the
`[(2w-1)^2, heads]` table and the shift mask from the tokens' regions in registers,
and writes the output where the token lies in the grid. Windows of 49 tokens run as 64
(`tl.dot` wants 16 at least). No roll, partition, reverse or score tensor exists.

The projection is per token, so projecting the grid and then reading windows is exactly
projecting windows. Scores and softmax are fp32 (the written-out bf16 model keeps them in
bf16 eagerly, fp32 inside inductor's fused softmax).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from models.aot import exporting
from models.triton_device import triton_installed

__all__ = [
    "WindowKernelConfig",
    "kernel_compiles",
    "shifted_window_attention",
    "window_attention",
]

_LOG2E = 1.4426950408889634
# CUDA's limit on a launch grid's second axis (the kernel's images x heads)
_MAX_GRID_Y = 65_535


class WindowKernelConfig:
    """Launch shape: one program per (window, head, image), this many warps."""

    num_warps: int = 4


def kernel_compiles(device: torch.device) -> bool:
    """Whether the kernel runs compiled on `device` (CUDA with Triton): where "auto" takes
    it. Triton's interpreter runs it anywhere, for the tests, but far too slowly to serve."""
    return device.type == "cuda" and triton_installed()


@functools.cache
def _kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def swin_window_fwd(
        QKV, TABLE, O,
        s_qb, s_qh, s_qw,
        s_ob, s_oh, s_ow,
        heads, channels, res_h, res_w, windows_w, shift,
        WINDOW: tl.constexpr, N_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, QK_SCALE: tl.constexpr, SHIFTED: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, LOG2E: tl.constexpr,
        MASKED: tl.constexpr,
    ):  # fmt: skip
        window_id = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        w_row = window_id // windows_w
        w_col = window_id % windows_w

        i = tl.arange(0, N_PAD)
        valid = i < WINDOW * WINDOW
        a = i // WINDOW
        c = i % WINDOW
        # the token's place on the rolled grid, and where it lies on the grid itself
        r = w_row * WINDOW + a
        col = w_col * WINDOW + c
        src_r = (r + shift) % res_h
        src_c = (col + shift) % res_w
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        tok = b.to(tl.int64) * s_qb + src_r * s_qh + src_c * s_qw
        ptrs = QKV + tok[:, None] + h * HEAD_DIM + d[None, :]
        io_mask = valid[:, None] & d_ok[None, :]
        q = tl.load(ptrs, mask=io_mask, other=0.0)
        k = tl.load(ptrs + channels, mask=io_mask, other=0.0)
        v = tl.load(ptrs + 2 * channels, mask=io_mask, other=0.0)
        if UPCAST:  # the same products: a bf16 or fp16 value is exact in fp32
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE  # log2 units
        # the bias table's row for the offset from key j to query i
        side = 2 * WINDOW - 1
        idx = (a[:, None] - a[None, :] + WINDOW - 1) * side + (c[:, None] - c[None, :] + WINDOW - 1)
        pair_ok = valid[:, None] & valid[None, :]
        bias = tl.load(TABLE + idx * heads + h, mask=pair_ok, other=0.0).to(tl.float32)
        s += bias * LOG2E
        if SHIFTED:
            # regions of the rolled grid: 0 inside, 1 and 2 the strips the roll brought in
            reg_r = (r >= res_h - WINDOW).to(tl.int32) + (r >= res_h - shift).to(tl.int32)
            reg_c = (col >= res_w - WINDOW).to(tl.int32) + (col >= res_w - shift).to(tl.int32)
            label = reg_r * 3 + reg_c
            s = tl.where(label[:, None] != label[None, :], s + MASKED * LOG2E, s)
        s = tl.where(valid[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        p = tl.math.exp2(s - m[:, None])
        den = tl.sum(p, 1)
        p = p.to(O.dtype.element_ty)  # rounded as the output's dtype, as the dot reads it
        out = tl.dot(p.to(v.dtype), v, input_precision=PRECISION) / den[:, None]
        o_tok = b.to(tl.int64) * s_ob + src_r * s_oh + src_c * s_ow
        o_ptrs = O + o_tok[:, None] + h * HEAD_DIM + d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)

    return swin_window_fwd


def _launch(
    qkv: Tensor, table: Tensor, heads: int, window: int, shift: int, traced: bool = False
) -> Tensor:
    """qkv `[B, H, W, 3C]` (any strides over B, H, W; each token's 3C contiguous), the
    bias table `[(2w-1)^2, heads]` -> `[B, H, W, C]`."""
    import triton

    from models.swin.model import MASKED  # here: the model module imports this one

    B, res_h, res_w, c3 = qkv.shape
    channels = c3 // 3
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    table = table.contiguous()
    head_dim = channels // heads
    if channels % heads or res_h % window or res_w % window:
        raise ValueError(
            f"a {res_h}x{res_w} grid of {channels} channels does not split into "
            f"{window}x{window} windows of {heads} heads"
        )
    if B * heads > _MAX_GRID_Y:
        # the grid's second axis; the service's batches stop far below (256 x 24 heads)
        raise ValueError(
            f"{B} images x {heads} heads is more than the kernel's {_MAX_GRID_Y} programs "
            "a window: split the batch"
        )
    out = qkv.new_empty(B, res_h, res_w, channels)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    windows_w = res_w // window
    grid = ((res_h // window) * windows_w, B * heads)
    kernel = torch.library.wrap_triton(_kernel()) if traced else _kernel()
    kernel[grid](
        qkv, table, out,
        qkv.stride(0), qkv.stride(1), qkv.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, channels, res_h, res_w, windows_w, shift,
        WINDOW=window, N_PAD=max(16, triton.next_power_of_2(window * window)),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        # a constant, not an argument: inductor's copy of a traced launch would take a
        # Python float argument as fp64
        QK_SCALE=head_dim**-0.5 * _LOG2E, SHIFTED=shift > 0,
        # an fp32 model's products in full fp32, not TF32's 10 bits
        PRECISION="ieee" if qkv.dtype == torch.float32 or interpreting else "tf32",
        # Triton's interpreter (the CPU tests') multiplies bf16 wrongly: fp32 operands there
        UPCAST=interpreting, LOG2E=_LOG2E, MASKED=MASKED,
        num_warps=WindowKernelConfig.num_warps,
    )  # fmt: skip
    return out


@torch.library.custom_op("swin_serve::window_attention", mutates_args=())
def window_attention(qkv: Tensor, table: Tensor, heads: int, window: int, shift: int) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias + shift mask) v for every (shifted) window of the
    grid: qkv `[B, H, W, 3C]` (the qkv projection of the normed, unrolled grid) -> `[B, H,
    W, C]` on the same grid, ready for the output projection. An opaque op to
    torch.compile (the kernel is already fused), captured by CUDA graphs."""
    return _launch(qkv, table, heads, window, shift)


@window_attention.register_fake
def _(qkv: Tensor, table: Tensor, heads: int, window: int, shift: int) -> Tensor:
    B, H, W, c3 = qkv.shape
    return qkv.new_empty(B, H, W, c3 // 3)


@functools.cache
def _exported_op() -> Any:
    """The traceable twin for torch.export (AOT packages): a package's C++ cannot call a
    Python custom op, but it carries a `triton_op`'s kernel. Registered at first use:
    defining it imports inductor, which a process that never exports should not pay."""

    @torch.library.triton_op("swin_serve::window_attention_exported", mutates_args=())
    def exported(qkv: Tensor, table: Tensor, heads: int, window: int, shift: int) -> Tensor:
        return _launch(qkv, table, heads, window, shift, traced=True)

    return exported


def shifted_window_attention(
    qkv: Tensor, table: Tensor, heads: int, window: int, shift: int
) -> Tensor:
    """`window_attention`, or its traceable twin while an AOT package is exported: what
    model code calls."""
    if exporting():
        return _exported_op()(qkv, table, heads, window, shift)
    return window_attention(qkv, table, heads, window, shift)
