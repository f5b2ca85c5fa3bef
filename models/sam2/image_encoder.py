"""SAM 2's image encoder: the Hiera trunk and an FPN neck, as SAM 2's image path uses them.

The neck projects every trunk stage to `d_model` channels with a 1x1 convolution and adds
nearest-upsampled coarser features only to the levels in `fpn_top_down_levels` (the two
coarsest in SAM 2.1: the two fine levels keep their own features, for the decoder's mask
upscaling). The coarsest level is then dropped (`scalp`), leaving strides 4, 8 and 16.
Each level also gets a sine position encoding (used by SAM 2's video memory; returned so
that the image path matches Meta's outputs exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.sam2.config import Sam2Config
from models.sam2.hiera import Hiera

__all__ = ["EncoderOutput", "FpnNeck", "ImageEncoder", "sine_position_encoding"]


@dataclass(frozen=True)
class EncoderOutput:
    """Neck features and their position encodings, finest first: strides 4, 8, 16."""

    features: list[Tensor]  # [B, d_model, S/4, S/4], [.., S/8, S/8], [.., S/16, S/16]
    pos: list[Tensor]  # same shapes


def sine_position_encoding(
    batch: int, h: int, w: int, dim: int, device: torch.device, temperature: float = 10000.0
) -> Tensor:
    """DETR's normalised 2-D sine encoding: `[batch, dim, h, w]` fp32, y half then x half.

    Positions 1..h (1..w) are scaled to (0, 2*pi]; channel pairs alternate sin/cos at
    geometrically spaced frequencies.
    """
    half = dim // 2
    eps = 1e-6
    ys = torch.arange(1, h + 1, dtype=torch.float32, device=device) / (h + eps) * (2 * math.pi)
    xs = torch.arange(1, w + 1, dtype=torch.float32, device=device) / (w + eps) * (2 * math.pi)
    idx = torch.arange(half, dtype=torch.float32, device=device)
    freq = temperature ** (2 * torch.div(idx, 2, rounding_mode="floor") / half)  # [half]

    def encode(p: Tensor) -> Tensor:  # [n] -> [n, half], sin/cos interleaved
        a = p[:, None] / freq
        return torch.stack((a[:, 0::2].sin(), a[:, 1::2].cos()), dim=2).flatten(1)

    pos_y = encode(ys)[:, None, :].expand(h, w, half)
    pos_x = encode(xs)[None, :, :].expand(h, w, half)
    pos = torch.cat((pos_y, pos_x), dim=2).permute(2, 0, 1)  # [dim, h, w]
    return pos[None].expand(batch, -1, -1, -1)


class Lateral(nn.Module):
    """One 1x1 projection; the wrapper exists for Meta's key names (`convs.N.conv.*`)."""

    def __init__(self, in_dim: int, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_dim, d_model, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class FpnNeck(nn.Module):
    """Trunk maps (finest first) -> `d_model`-wide maps with top-down fusion and sine PEs."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.d_model = config.d_model
        self.top_down_levels = set(config.fpn_top_down_levels)
        # convs[0] projects the coarsest stage, as in Meta's `backbone_channel_list`
        self.convs = nn.ModuleList(
            Lateral(dim, config.d_model) for dim in config.backbone_channel_list
        )

    def forward(self, xs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        n = len(self.convs) - 1
        out: list[Tensor] = [xs[0]] * len(xs)
        prev: Tensor | None = None
        for i in range(n, -1, -1):  # coarsest first
            lateral = self.convs[n - i](xs[i])
            if i in self.top_down_levels and prev is not None:
                # nearest copies values, so it is exact in any dtype (Meta upcasts to fp32
                # first, which would leave a bf16 model with one fp32 level)
                top_down = F.interpolate(prev, scale_factor=2.0, mode="nearest")
                prev = lateral + top_down
            else:
                prev = lateral
            out[i] = prev
        pos = [
            sine_position_encoding(x.shape[0], x.shape[2], x.shape[3], self.d_model, x.device).to(
                x.dtype
            )
            for x in out
        ]
        return out, pos


class ImageEncoder(nn.Module):
    """Trunk + neck, keeping the three finest levels (strides 4, 8, 16)."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.scalp = config.scalp
        self.trunk = Hiera(config)
        self.neck = FpnNeck(config)

    def forward(self, images: Tensor) -> EncoderOutput:
        """images `[B, 3, S, S]`, normalised -> features at strides 4, 8, 16."""
        features, pos = self.neck(self.trunk(images))
        keep = len(features) - self.scalp
        return EncoderOutput(features=features[:keep], pos=pos[:keep])
