"""Hiera, SAM 2's image trunk: a hierarchical ViT with windowed attention and q-pooling.

Four stages at strides 4, 8, 16 and 32 (Hiera, arXiv 2306.00989, as configured in SAM 2).
The first block of stages 2-4 doubles the width and the heads and max-pools its queries
2x2 *inside each window*, so the map halves while keys and values keep full resolution.
A few blocks attend globally; the rest attend within square windows, zero-padded where
the window does not divide the map. The absolute position embedding is a small
"background" table interpolated bicubically to the token grid plus a per-window table
tiled over it (SAM 2's windowed positional embedding). Attribute names follow Meta's
so that their checkpoints load key for key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.sam2.config import Sam2Config

__all__ = ["Hiera"]

_Q_STRIDE = 2  # SAM 2 pools 2x2 between stages


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    """`[B, H, W, C]` -> `[B * nW, window, window, C]` and the padded size (Hp, Wp)."""
    B, H, W, C = x.shape
    pad_h, pad_w = (-H) % window, (-W) % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window, window, Wp // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window, window, C), (Hp, Wp)


def window_unpartition(
    windows: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]
) -> Tensor:
    """Inverse of `window_partition`, cropping the padding: -> `[B, H, W, C]`."""
    Hp, Wp = padded
    H, W = size
    B = windows.shape[0] // ((Hp // window) * (Wp // window))
    x = windows.reshape(B, Hp // window, Wp // window, window, window, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, -1)
    return x[:, :H, :W, :] if (Hp > H or Wp > W) else x


def pool_2x2(x: Tensor) -> Tensor:
    """2x2 max-pool of a channels-last map `[B, H, W, C]` (odd edges dropped, as Meta's)."""
    return F.max_pool2d(x.permute(0, 3, 1, 2), _Q_STRIDE, _Q_STRIDE).permute(0, 2, 3, 1)


class FeedForward(nn.Module):
    """Two linear layers with GELU; `layers.0`/`layers.1` are Meta's key names."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.layers[1](F.gelu(self.layers[0](x)))


class MultiScaleAttention(nn.Module):
    """Self-attention whose queries may be pooled 2x2, shrinking the output map."""

    def __init__(self, dim: int, dim_out: int, num_heads: int, pool_q: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.pool_q = pool_q
        self.qkv = nn.Linear(dim, dim_out * 3)
        self.proj = nn.Linear(dim_out, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        """x `[B, H, W, C]` (B counts windows) -> `[B, H', W', C_out]`."""
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1)
        q, k, v = qkv.unbind(2)  # each [B, H*W, heads, c]
        if self.pool_q:
            q = pool_2x2(q.reshape(B, H, W, -1))
            H, W = q.shape[1:3]
            q = q.reshape(B, H * W, self.num_heads, -1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )  # [B, heads, H'*W', c]
        return self.proj(out.transpose(1, 2).reshape(B, H, W, -1))


class MultiScaleBlock(nn.Module):
    """Pre-norm attention + MLP block; a stage's first block also widens and pools."""

    def __init__(
        self,
        dim: int,
        dim_out: int,
        num_heads: int,
        mlp_ratio: float,
        pool_q: bool,
        window_size: int,
    ) -> None:
        super().__init__()
        self.dim, self.dim_out = dim, dim_out
        self.pool_q = pool_q
        self.window_size = window_size  # 0: global attention
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiScaleAttention(dim, dim_out, num_heads, pool_q)
        self.norm2 = nn.LayerNorm(dim_out, eps=1e-6)
        self.mlp = FeedForward(dim_out, int(dim_out * mlp_ratio))
        if dim != dim_out:
            self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        """x `[B, H, W, dim]` -> `[B, H', W', dim_out]` (H' = H/2 where queries are pooled)."""
        shortcut = x
        x = self.norm1(x)
        if self.dim != self.dim_out:
            # the residual is widened from the *normed* input, then pooled like the queries
            shortcut = self.proj(x)
            if self.pool_q:
                shortcut = pool_2x2(shortcut)
        window = self.window_size
        H, W = x.shape[1:3]
        padded = (H, W)
        if window > 0:
            x, padded = window_partition(x, window)
        x = self.attn(x)
        if self.pool_q:
            # each window's queries were pooled: smaller windows over the pooled map
            window //= _Q_STRIDE
            H, W = shortcut.shape[1:3]
            padded = (H + (-H) % window, W + (-W) % window) if window > 0 else (H, W)
        if self.window_size > 0:
            x = window_unpartition(x, window, padded, (H, W))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """7x7 stride-4 convolution to the first stage's width, channels-last output."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=7, stride=4, padding=3)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).permute(0, 2, 3, 1)  # [B, H/4, W/4, C]


class Hiera(nn.Module):
    """The trunk: `[B, 3, S, S]` -> four maps `[B, C_i, S/4/2**i, S/4/2**i]`, finest first."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.stage_ends = config.stage_ends
        dim = config.embed_dim
        heads = config.num_heads
        self.patch_embed = PatchEmbed(dim)
        self.pos_embed = nn.Parameter(
            torch.zeros(1, dim, *config.window_pos_embed_bkg_spatial_size)
        )
        first_window = config.window_spec[0]
        self.pos_embed_window = nn.Parameter(torch.zeros(1, dim, first_window, first_window))
        pool_blocks = {end + 1 for end in self.stage_ends[:-1]}
        blocks: list[MultiScaleBlock] = []
        stage = 0
        for i in range(config.depth):
            # the pooling block still uses the previous stage's window (then halves it)
            window = 0 if i in config.global_att_blocks else config.window_spec[stage]
            dim_out = dim
            if i in pool_blocks:
                dim_out, heads, stage = dim * 2, heads * 2, stage + 1
            blocks.append(
                MultiScaleBlock(dim, dim_out, heads, config.mlp_ratio, i in pool_blocks, window)
            )
            dim = dim_out
        self.blocks = nn.ModuleList(blocks)

    def abs_pos_embed(self, h: int, w: int) -> Tensor:
        """Background table resized to the grid plus the window table tiled: `[1, h, w, C]`."""
        pos = F.interpolate(self.pos_embed, size=(h, w), mode="bicubic")
        win = self.pos_embed_window
        pos = pos + win.tile(1, 1, h // win.shape[2], w // win.shape[3])
        return pos.permute(0, 2, 3, 1)

    def forward(self, images: Tensor) -> list[Tensor]:
        x = self.patch_embed(images)
        x = x + self.abs_pos_embed(x.shape[1], x.shape[2])
        outputs: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.stage_ends:
                outputs.append(x.permute(0, 3, 1, 2))
        return outputs
