"""SAM's prompt encoder: points, box corners and low-res masks -> decoder inputs.

Sparse prompts arrive already canonicalised by `pack_prompts` as one token list per
prompt set (box corners are tokens with their own labels), so encoding them is a gather
plus a positional encoding, with no per-type branches. Positional encodings are always
computed in fp32: a bf16 coordinate would be off by several pixels at 1024.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn

from models.sam.common import LayerNorm2d
from models.sam.config import SamConfig

__all__ = ["LABEL_BOX_BR", "LABEL_BOX_TL", "LABEL_NOT_A_POINT", "LABEL_PAD", "PromptEncoder"]

# Token labels, as in Meta's prompt encoder (-1 not-a-point, 0 negative, 1 positive),
# extended with the two box corners and a padding token that the decoder masks out.
LABEL_PAD = -2
LABEL_NOT_A_POINT = -1
LABEL_BOX_TL = 2
LABEL_BOX_BR = 3


class PositionEmbeddingRandom(nn.Module):
    """Fourier features with a fixed random Gaussian matrix (`[2, D/2]`, part of the weights)."""

    def __init__(self, num_pos_feats: int) -> None:
        super().__init__()
        self.register_buffer("positional_encoding_gaussian_matrix", torch.randn(2, num_pos_feats))
        self.positional_encoding_gaussian_matrix: Tensor

    def encode(self, coords: Tensor) -> Tensor:
        """coords `[..., 2]` (x, y) normalized to [0, 1] -> `[..., D]` fp32 features."""
        coords = 2 * coords.float() - 1
        coords = coords @ self.positional_encoding_gaussian_matrix.float()
        coords = 2 * math.pi * coords
        return torch.cat([torch.sin(coords), torch.cos(coords)], dim=-1)

    def dense(self, h: int, w: int) -> Tensor:
        """Encoding of every cell centre of an `h x w` grid: `[D, h, w]` fp32."""
        device = self.positional_encoding_gaussian_matrix.device
        ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
        xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
        grid = torch.stack(torch.broadcast_tensors(xs[None, :], ys[:, None]), dim=-1)
        return self.encode(grid).permute(2, 0, 1)


class PromptEncoder(nn.Module):
    """Embeds prompt tokens (`[P, T, D]`), the dense prompt (`[P, D, h, w]`) and the dense PE."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        dim = config.prompt_embed_dim
        chans = config.mask_in_chans
        self.embed_dim = dim
        self.input_image_size = (config.image_size, config.image_size)
        self.image_embedding_size = (config.embedding_size, config.embedding_size)
        self.pe_layer = PositionEmbeddingRandom(dim // 2)
        # 0: negative point, 1: positive point, 2: box top-left, 3: box bottom-right
        self.point_embeddings = nn.ModuleList(nn.Embedding(1, dim) for _ in range(4))
        self.not_a_point_embed = nn.Embedding(1, dim)
        self.mask_downscaling = nn.Sequential(
            nn.Conv2d(1, chans // 4, kernel_size=2, stride=2),
            LayerNorm2d(chans // 4),
            nn.GELU(),
            nn.Conv2d(chans // 4, chans, kernel_size=2, stride=2),
            LayerNorm2d(chans),
            nn.GELU(),
            nn.Conv2d(chans, dim, kernel_size=1),
        )
        self.no_mask_embed = nn.Embedding(1, dim)

    def dense_pe(self) -> Tensor:
        """Positional encoding of the image embedding grid: `[1, D, h, w]` fp32."""
        return self.pe_layer.dense(*self.image_embedding_size).unsqueeze(0)

    def embed_tokens(self, points: Tensor, labels: Tensor) -> Tensor:
        """points `[P, T, 2]` (model input pixels), labels `[P, T]` -> `[P, T, D]` fp32.

        Labels -1 (not a point) and -2 (padding) carry no position, only the
        not-a-point embedding; labels 0..3 add their learned type embedding to the
        position of the pixel centre (hence the +0.5).
        """
        height, width = self.input_image_size
        centre = points.float() + 0.5
        # Python scalars, not a tensor built here: that would be a host-to-device copy
        # (a sync) on every decode.
        pe = self.pe_layer.encode(
            torch.stack((centre[..., 0] / width, centre[..., 1] / height), -1)
        )
        has_position = (labels >= 0)[..., None]
        pe = torch.where(has_position, pe, torch.zeros_like(pe))
        kinds = [cast(nn.Embedding, e).weight for e in self.point_embeddings]
        table = torch.cat([self.not_a_point_embed.weight, *kinds]).float()  # [5, D]: label+1 -> row
        return pe + table[labels.clamp(min=LABEL_NOT_A_POINT) + 1]

    def embed_dense(
        self, mask_input: Tensor | None, has_mask_input: Tensor | None, num_sets: int
    ) -> Tensor:
        """Dense prompt per set: downscaled `mask_input` where given, else `no_mask_embed`.

        mask_input `[P, 1, 4h, 4w]`, has_mask_input `[P]` bool (both None when no set in
        the batch has a mask) -> `[P, D, h, w]` in the model's dtype.
        """
        h, w = self.image_embedding_size
        no_mask = self.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(num_sets, -1, h, w)
        if mask_input is None or has_mask_input is None:
            return no_mask
        embedded = self.mask_downscaling(mask_input.to(no_mask.dtype))
        return torch.where(has_mask_input[:, None, None, None], embedded, no_mask)
