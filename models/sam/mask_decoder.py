"""SAM's mask decoder: output tokens + prompt tokens -> 4 low-res masks and their IoU scores.

All four mask tokens are always computed and returned (token 0 is the single-mask
answer, tokens 1..3 the multimask ones); slicing is left to the caller so that one
batch can mix single- and multimask requests.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.sam.common import MLP, LayerNorm2d
from models.sam.config import SamConfig
from models.sam.transformer import TwoWayTransformer

__all__ = ["MaskDecoder"]


class MaskDecoder(nn.Module):
    """Two-way transformer, 4x transposed-conv upscaling and per-token hypernetwork MLPs."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        dim = config.prompt_embed_dim
        self.num_mask_tokens = config.num_mask_tokens
        self.transformer = TwoWayTransformer(
            depth=config.decoder_depth,
            embedding_dim=dim,
            num_heads=config.decoder_num_heads,
            mlp_dim=config.decoder_mlp_dim,
        )
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(self.num_mask_tokens, dim)
        self.output_upscaling = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 4, kernel_size=2, stride=2),
            LayerNorm2d(dim // 4),
            nn.GELU(),
            nn.ConvTranspose2d(dim // 4, dim // 8, kernel_size=2, stride=2),
            nn.GELU(),
        )
        self.output_hypernetworks_mlps = nn.ModuleList(
            MLP(dim, dim, dim // 8, 3) for _ in range(self.num_mask_tokens)
        )
        self.iou_prediction_head = MLP(
            dim, config.iou_head_hidden_dim, self.num_mask_tokens, config.iou_head_depth
        )

    def forward(
        self,
        image: Tensor,
        image_pe: Tensor,
        prompt_tokens: Tensor,
        token_valid: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Predict every mask token's mask and score.

        image: `[P, D, h, w]` (embedding of each set's image plus its dense prompt);
        image_pe: `[1, D, h, w]`; prompt_tokens: `[P, T, D]`; token_valid: `[P, T]` bool.
        Returns masks `[P, 4, 4h, 4w]` and iou `[P, 4]`.
        """
        P, D, h, w = image.shape
        output_tokens = torch.cat([self.iou_token.weight, self.mask_tokens.weight])  # [5, D]
        tokens = torch.cat([output_tokens.expand(P, -1, -1), prompt_tokens], dim=1)
        valid = torch.cat(
            [token_valid.new_ones(P, output_tokens.shape[0]), token_valid], dim=1
        )  # [P, 5 + T]

        hs, image_tokens = self.transformer(image, image_pe, tokens, valid)
        iou_token_out = hs[:, 0]  # [P, D]
        mask_tokens_out = hs[:, 1 : 1 + self.num_mask_tokens]  # [P, 4, D]

        upscaled = self.output_upscaling(image_tokens.transpose(1, 2).reshape(P, D, h, w))
        hyper_in = torch.stack(
            [mlp(mask_tokens_out[:, i]) for i, mlp in enumerate(self.output_hypernetworks_mlps)],
            dim=1,
        )  # [P, 4, D/8]
        _, c, H, W = upscaled.shape
        masks = (hyper_in @ upscaled.reshape(P, c, H * W)).reshape(P, -1, H, W)
        return masks, self.iou_prediction_head(iou_token_out)
