"""SAM's ViT image encoder (ViTDet style: windowed + global attention, decomposed rel-pos).

`[B, 3, S, S]` normalized pixels -> `[B, 256, S/16, S/16]` embedding. Most blocks attend
inside non-overlapping windows (the grid zero-padded to a multiple of the window), a few
attend globally. Attention with the decomposed relative-position term is in `attention.py`:
a dense bias through `scaled_dot_product_attention`, or FlexAttention that never builds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.quant_linear import linear_then_residual
from models.sam.attention import AttentionImpl, fused_qkv_attention, rel_pos_attention
from models.sam.common import LayerNorm2d, MLPBlock
from models.sam.config import SamConfig

__all__ = ["ImageEncoderViT", "window_partition", "window_unpartition"]


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    """`[B, H, W, C]` -> (`[B * nW, window, window, C]`, padded (Hp, Wp)).

    The grid is zero-padded bottom/right to a multiple of `window`; padded tokens take part
    in the window attention exactly as in Meta's encoder (they are not masked).
    """
    B, H, W, C = x.shape
    pad_h, pad_w = -H % window, -W % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window, window, Wp // window, window, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window, window, C)
    return windows, (Hp, Wp)


def window_unpartition(
    windows: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]
) -> Tensor:
    """Inverse of `window_partition`: `[B * nW, window, window, C]` -> `[B, H, W, C]`."""
    Hp, Wp = padded
    H, W = size
    B = windows.shape[0] // ((Hp // window) * (Wp // window))
    x = windows.view(B, Hp // window, Wp // window, window, window, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, -1)
    return x[:, :H, :W, :]


class Attention(nn.Module):
    """Multi-head self-attention over a 2-D grid with decomposed relative positions."""

    def __init__(self, dim: int, num_heads: int, grid: tuple[int, int]) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * grid[0] - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * grid[1] - 1, head_dim))
        # "sdpa" (dense bias), "flex" or "triton" (fused, global blocks); see attention.py
        self.impl: AttentionImpl = "sdpa"

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x: `[B, h, w, D]` -> `[B, h, w, D]`, plus `residual` if given (in the output
        projection's epilogue where it is a quantised layer)."""
        # the width from the projection: x may be packed quantised rows (models.ln_quant)
        B, h, w = x.shape[:3]
        D = self.proj.out_features
        qkv = self.qkv(x).reshape(B, h * w, 3, self.num_heads, -1)  # [B, N, 3, heads, C]
        if self.impl == "triton":
            # the kernel reads q, k, v out of qkv and writes [B, N, heads * C]: no copies
            out = fused_qkv_attention(qkv, self.rel_pos_h, self.rel_pos_w, (h, w),
                                      self._proj_inv_scale())  # fmt: skip
            return linear_then_residual(self.proj, out.reshape(B, h, w, D), residual)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, h*w, head_dim]
        out = rel_pos_attention(q, k, v, self.rel_pos_h, self.rel_pos_w, (h, w), self.impl)
        out = out.transpose(1, 2).reshape(B, h, w, D)
        return linear_then_residual(self.proj, out, residual)

    def _proj_inv_scale(self) -> Tensor | None:
        """The output projection's fixed input scales (inverted), where it takes its input
        so (`OptimizeOptions.proj_static`): the fused kernels then write their output int8
        by them (the Gluon kernels in their epilogue), not bf16 for a pass that quantises
        it per token (0.40 ms of a batch of 8 on an H100)."""
        return getattr(self.proj, "input_inv_scale", None)

    def windowed(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x: the whole `[B, H, W, D]` grid -> `[B, H, W, D]`, attending in this module's
        windows (the Triton kernel; `forward` on `window_partition`'s windows is the same
        function): qkv and the output projection run on the grid's tokens only, and the
        kernel reads each window where it lies."""
        from models.sam.fused_attention import window_flash

        B, H, W = x.shape[:3]
        D = self.proj.out_features
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1)
        bias = getattr(self.qkv, "bias", None)
        out = window_flash(qkv, self.rel_pos_h, self.rel_pos_w, bias, H, W,
                           self._proj_inv_scale())  # fmt: skip
        return linear_then_residual(self.proj, out.reshape(B, H, W, D), residual)


class Block(nn.Module):
    """Pre-norm transformer block; `window == 0` means global attention."""

    # A windowed block on the Triton kernel reads its windows where they lie in the grid
    # (`Attention.windowed`) instead of partitioning; set by `prepare_sam_encoder`.
    windows_in_place: bool = False
    # The attention's residual goes into its output projection (`proj_residual`: the
    # quantised projection adds it in its epilogue, so no pass of its own adds it before
    # the quantising norm, which is a custom op inductor cannot fuse an add into); not on
    # partitioned windows, whose projection's rows are the windows'.
    residual_in_proj: bool = False

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, window: int, grid: tuple[int, int]
    ) -> None:
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, grid if window == 0 else (window, window))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        """x: `[B, H, W, D]` -> `[B, H, W, D]`."""
        shortcut = x
        x = self.norm1(x)
        residual = shortcut if self.residual_in_proj else None
        if self.window > 0 and self.windows_in_place:
            # no partition copies, no padded tokens projected
            x = self.attn.windowed(x, residual)
        elif self.window > 0:
            size = (x.shape[1], x.shape[2])
            windows, padded = window_partition(x, self.window)
            x = window_unpartition(self.attn(windows), self.window, padded, size)
            residual = None  # the projection's rows were the windows': added below
        else:
            x = self.attn(x, residual)
        if residual is None:
            x = shortcut + x
        return self.mlp(self.norm2(x), residual=x)  # x + mlp(norm2(x))


class PatchEmbed(nn.Module):
    """Non-overlapping patch projection: `[B, 3, S, S]` -> `[B, S/p, S/p, D]` (channels last)."""

    def __init__(self, patch_size: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        # A stride-p conv over non-overlapping p x p patches is one matmul over the patches:
        # cuDNN ran this conv as a generic implicit GEMM at ~18 TFLOP/s on an H100, 8% of
        # the encoder's time (docs/BENCHMARKS.md). Same weights, same sums, one GEMM.
        B, C, H, W = x.shape
        p = self.proj.kernel_size[0]
        patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(B, H // p, W // p, C * p * p)  # (c, ky, kx) as the weight
        weight = self.proj.weight.reshape(self.proj.out_channels, C * p * p)
        return F.linear(patches, weight, self.proj.bias)  # [B, H/p, W/p, D]


class ImageEncoderViT(nn.Module):
    """The SAM backbone plus its neck (1x1 conv, LN, 3x3 conv, LN) down to 256 channels."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.img_size = config.image_size
        side = config.embedding_size
        dim = config.encoder_embed_dim
        self.patch_embed = PatchEmbed(config.patch_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, side, side, dim))
        global_blocks = set(config.encoder_global_attn_indexes)
        self.blocks = nn.ModuleList(
            Block(
                dim,
                config.encoder_num_heads,
                config.mlp_ratio,
                0 if i in global_blocks else config.window_size,
                (side, side),
            )
            for i in range(config.encoder_depth)
        )
        out = config.prompt_embed_dim
        self.neck = nn.Sequential(
            nn.Conv2d(dim, out, kernel_size=1, bias=False),
            LayerNorm2d(out),
            nn.Conv2d(out, out, kernel_size=3, padding=1, bias=False),
            LayerNorm2d(out),
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: `[B, 3, S, S]` -> `[B, 256, S/16, S/16]`."""
        x = self.patch_embed(x) + self.pos_embed  # [B, S/16, S/16, D]
        for block in self.blocks:
            x = block(x)
        return self.neck(x.permute(0, 3, 1, 2))
