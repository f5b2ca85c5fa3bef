"""LayerNorm that writes its output quantised (int8 or fp8 e4m3) with the row's scale, in one
pass, for the quantised Linear after it (issue 20).

Why: a dynamic int8/fp8 Linear quantises its input per token, a pass that reads the bf16
activation and writes the low-precision row and its scale; on an H100 that pass ate most of
the fused GEMM's gain (docs/BENCHMARKS.md). In a pre-norm block the input of qkv and of the
MLP's first Linear is a LayerNorm's output, whose whole row the norm already holds: it can
as well find the row's absmax and write the quantised row instead of the bf16 one.

The packed activation: between the norm and the Linear, Swin rolls and partitions the tokens
into windows and SAM pads its grid to whole windows; each moves whole rows, so the scale
travels inside its row. A packed row is `K + 16` bytes (int8): the `K` quantised values
(int8, or e4m3's bytes), the fp32 scale, 12 bytes of padding (rows stay 16-byte aligned for
the GEMM's vector loads). A zero row (SAM's padding) has scale 0: the Linear gives its bias,
as the float model does for a zero input. The Linear (`models.quantize.DynamicQuantLinear`)
takes a packed int8 input as it is (`serve::packed_linear`) and quantises a float one itself.

`fuse_norm_quant` swaps the norms of Swin's and SAM's encoder blocks whose Linear after them
is quantised; the attention modules read the width from their projection, not from the
input's last dimension, so the packed rows pass through them. On CUDA with Triton the norm
is a kernel (`serve::layer_norm_quant`); elsewhere the same arithmetic in torch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.fp8_gemm import FP8, fp8_linear, quantize_rows_fp8
from models.int8_gemm import fused_supported, int8_linear, quantize_rows

__all__ = [
    "PACK_PAD",
    "QuantizingLayerNorm",
    "fuse_norm_quant",
    "layer_norm_quant",
    "layer_norm_quant_reference",
    "pack_rows",
    "packed_linear",
    "unpack_rows",
]

PACK_PAD = 16  # bytes after each packed row: its fp32 scale, then padding


def pack_rows(q: Tensor, scale: Tensor) -> Tensor:
    """(`[M, K]` int8 or e4m3, `[M]` fp32) -> `[M, K + 16]` int8 packed rows."""
    m = q.shape[0]
    scale_bytes = scale.float().contiguous().view(torch.int8).reshape(m, 4)
    pad = q.new_zeros((m, PACK_PAD - 4), dtype=torch.int8)
    return torch.cat([q.view(torch.int8), scale_bytes, pad], dim=1)


def unpack_rows(packed: Tensor, fp8: bool) -> tuple[Tensor, Tensor]:
    """`[M, K + 16]` packed rows -> (`[M, K]` values, `[M]` fp32 scales): views, no copy
    (after one when the rows are not laid out one after the other)."""
    k = packed.shape[1] - PACK_PAD
    if packed.stride(1) != 1 or packed.stride(0) % 16 or packed.storage_offset() % 16:
        packed = packed.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    q = packed[:, :k]
    scale = packed.view(torch.float32)[:, k // 4]
    return (q.view(FP8) if fp8 else q), scale


def layer_norm_quant_reference(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, fp8: bool
) -> Tensor:
    """The kernel's arithmetic in torch: the norm in fp32 (not rounded to the activation's
    dtype before it is quantised), then `quantize_rows` / `quantize_rows_fp8`, packed."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    q, scale = quantize_rows_fp8(y) if fp8 else quantize_rows(y)
    return pack_rows(q, scale)


quantize_rows_tile: Any = None  # models.triton_quant's, set when the kernel is built


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # a module global: Triton resolves a kernel's callees among its module's globals
    global quantize_rows_tile
    from models.triton_quant import quantize_rows_tile

    @triton.jit
    def layer_norm_quant_kernel(
        X, W, B, P, M, C, stride_x, stride_p, eps,
        IS_FP8: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        row_ok = rows < M
        col_ok = cols < C
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = d * rstd[:, None] * w[None, :] + b[None, :]  # 0 past C (w = b = 0 there)
        q, scale = quantize_rows_tile(y, mask, IS_FP8)
        row_p = P + rows64 * stride_p
        tl.store(row_p[:, None] + cols[None, :], q, mask=mask)
        scale_p = (row_p + C).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(scale_p, scale, mask=row_ok)

    return layer_norm_quant_kernel


# (rows a program, warps) for every launch in place of `launch_shape`'s, when set
# (bench/ln_quant_sweep.py times the shapes against each other)
SHAPE: tuple[int, int] | None = None


def launch_shape(block_c: int) -> tuple[int, int]:
    """Rows a program and its warps: about 4K values a program, 4 warps."""
    if SHAPE is not None:
        return SHAPE
    return max(1, min(16, 4096 // block_c)), 4


def launch_layer_norm_quant(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, fp8: bool
) -> Tensor:
    """The kernel on `x [M, C]` (C a multiple of 16) -> `[M, C + 16]` packed rows."""
    import triton

    x = x if x.stride(1) == 1 else x.contiguous()
    m, c = x.shape
    out = torch.empty(m, c + PACK_PAD, dtype=torch.int8, device=x.device)
    if m == 0:
        return out
    block_c = triton.next_power_of_2(c)
    rows, warps = launch_shape(block_c)
    _kernel()[(triton.cdiv(m, rows),)](
        x, weight.contiguous(), bias.contiguous(), out, m, c, x.stride(0), out.stride(0), eps,
        IS_FP8=fp8, BLOCK_C=block_c, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return out


@torch.library.custom_op("serve::layer_norm_quant", mutates_args=())
def layer_norm_quant(x: Tensor, weight: Tensor, bias: Tensor, eps: float, fp8: bool) -> Tensor:
    """LayerNorm of `x [M, C]` -> `[M, C + 16]` int8 packed rows (int8 or e4m3 values, each
    row's fp32 scale after them): the Triton kernel on CUDA, its torch reference elsewhere."""
    if fused_supported(x.device):
        return launch_layer_norm_quant(x, weight, bias, eps, fp8)
    return layer_norm_quant_reference(x, weight, bias, eps, fp8)


@layer_norm_quant.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float, fp8: bool) -> Tensor:
    return x.new_empty((x.shape[0], x.shape[1] + PACK_PAD), dtype=torch.int8)


@torch.library.custom_op("serve::packed_linear", mutates_args=())
def packed_linear(
    packed: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """`serve::int8_linear` / `serve::fp8_linear` (by `weight`'s dtype) on packed rows
    `[M, K + 16]`: the values and scales are read where they lie, in place."""
    fp8 = weight.dtype == FP8
    xq, x_scale = unpack_rows(packed, fp8)
    op = fp8_linear if fp8 else int8_linear
    return op(xq, x_scale, weight, w_scale, bias, residual, gelu, out_dtype)


@packed_linear.register_fake
def _(
    packed: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    return packed.new_empty((packed.shape[0], weight.shape[0]), dtype=out_dtype)


class QuantizingLayerNorm(nn.Module):
    """A LayerNorm whose output is packed quantised rows (`[..., C + 16]` int8) for the
    quantised Linear it feeds; same parameters (and state-dict keys) as the norm."""

    def __init__(self, norm: nn.LayerNorm, fp8: bool) -> None:
        super().__init__()
        if norm.weight is None or norm.bias is None or len(norm.normalized_shape) != 1:
            raise ValueError("QuantizingLayerNorm takes a LayerNorm over the last dim, affine")
        self.weight, self.bias = norm.weight, norm.bias
        self.eps = norm.eps
        self.width = norm.normalized_shape[0]
        self.fp8 = fp8

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}, out={'fp8' if self.fp8 else 'int8'} packed"

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        packed = layer_norm_quant(x.reshape(-1, self.width), self.weight, self.bias,
                                  self.eps, self.fp8)  # fmt: skip
        return packed.reshape(*shape[:-1], self.width + PACK_PAD)


def _pairs(block: nn.Module) -> list[tuple[str, str]]:
    """(norm, the quantised Linear it feeds) in a pre-norm block of Swin or SAM's encoder."""
    from models.sam.image_encoder import Block
    from models.swin.model import SwinBlock

    if isinstance(block, SwinBlock):
        return [("norm1", "attn.qkv"), ("norm2", "mlp.fc1")]
    if isinstance(block, Block):
        return [("norm1", "attn.qkv"), ("norm2", "mlp.lin1")]
    return []


def fuse_norm_quant(module: nn.Module) -> list[str]:
    """Swap each block norm whose next Linear is quantised by the fused kernel (int8 or
    fp8) for a `QuantizingLayerNorm`; returns the swapped norms' names. Layers the per-layer
    choice kept in float keep their plain norm."""
    from models.quantize import DynamicQuantLinear

    fused = []
    for name, block in module.named_modules():
        for norm_name, linear_name in _pairs(block):
            norm = getattr(block, norm_name)
            linear = block.get_submodule(linear_name)
            if (
                type(norm) is nn.LayerNorm
                and isinstance(linear, DynamicQuantLinear)
                and linear.kernel == "fused"
            ):
                setattr(block, norm_name, QuantizingLayerNorm(norm, fp8=linear.kind == "fp8"))
                fused.append(f"{name}.{norm_name}" if name else norm_name)
    return fused
