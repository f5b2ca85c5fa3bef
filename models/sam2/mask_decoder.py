"""SAM 2's mask decoder: SAM's two-way transformer plus high-resolution skip features.

What SAM 2 changes in SAM's decoder:
- an object-score token before the IoU token, read by a 3-layer MLP (does the prompted
  object appear at all; the image predictor returns the masks regardless);
- the IoU head ends in a sigmoid (scores are probabilities, not raw regressions);
- the upscaling adds the backbone's stride-8 and stride-4 features after each transposed
  convolution; `conv_s1`/`conv_s0` project them to the upscaling widths. They are applied
  once per image at encode time (`models.sam2.model.Sam2Encoder`), not on every click;
- a single-mask answer whose logits are unstable under a +/-delta threshold shift is
  replaced by the multimask candidate with the best predicted IoU.
The transformer is `models.sam`'s (identical layers), so padding masks work the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.sam.common import MLP, LayerNorm2d
from models.sam.transformer import TwoWayTransformer
from models.sam2.config import Sam2Config
from models.sam2.upscale_kernel import upscale_masks
from models.triton_device import runs_triton

__all__ = ["Sam2MaskDecoder", "select_masks"]


class Sam2MaskDecoder(nn.Module):
    """Tokens + image embedding + high-res features -> 4 low-res masks, IoU and object score."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        dim = config.d_model
        self.num_mask_tokens = config.num_mask_tokens
        self.transformer = TwoWayTransformer(
            depth=config.decoder_depth,
            embedding_dim=dim,
            num_heads=config.decoder_num_heads,
            mlp_dim=config.decoder_mlp_dim,
        )
        self.obj_score_token = nn.Embedding(1, dim)
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(self.num_mask_tokens, dim)
        self.output_upscaling = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 4, kernel_size=2, stride=2),
            LayerNorm2d(dim // 4),
            nn.GELU(),
            nn.ConvTranspose2d(dim // 4, dim // 8, kernel_size=2, stride=2),
            nn.GELU(),
        )
        self.conv_s0 = nn.Conv2d(dim, dim // 8, kernel_size=1)
        self.conv_s1 = nn.Conv2d(dim, dim // 4, kernel_size=1)
        self.output_hypernetworks_mlps = nn.ModuleList(
            MLP(dim, dim, dim // 8, 3) for _ in range(self.num_mask_tokens)
        )
        self.iou_prediction_head = MLP(
            dim, config.iou_head_hidden_dim, self.num_mask_tokens, config.iou_head_depth
        )
        self.pred_obj_score_head = MLP(dim, dim, 1, 3)
        # the upscaling, skips and hypernetwork product as one Triton kernel
        # (models/sam2/upscale_kernel.py): on where `default_decoder_paths` says (CUDA)
        self.fused_upscale = False

    def forward(
        self,
        image: Tensor,
        image_pe: Tensor,
        high_res: tuple[Tensor, Tensor],
        prompt_tokens: Tensor,
        token_valid: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every mask token's mask and score.

        image: `[P or 1, D, h, w]` (embedding plus dense prompt; one row when every set
        has the same); image_pe `[1, D, h, w]`;
        high_res: projected (s0 `[P or 1, D/8, 4h, 4w]`, s1 `[P or 1, D/4, 2h, 2w]`);
        prompt_tokens `[P, T, D]`; token_valid `[P, T]` bool.
        Returns masks `[P, 4, 4h, 4w]`, iou `[P, 4]` in [0, 1], object logits `[P, 1]`.
        """
        P = prompt_tokens.shape[0]
        _, D, h, w = image.shape
        output_tokens = torch.cat(
            [self.obj_score_token.weight, self.iou_token.weight, self.mask_tokens.weight]
        )  # [6, D]
        tokens = torch.cat([output_tokens.expand(P, -1, -1), prompt_tokens], dim=1)
        valid = torch.cat([token_valid.new_ones(P, output_tokens.shape[0]), token_valid], dim=1)

        hs, image_tokens = self.transformer(image, image_pe, tokens, valid)
        obj_token_out = hs[:, 0]
        iou_token_out = hs[:, 1]
        mask_tokens_out = hs[:, 2 : 2 + self.num_mask_tokens]  # [P, 4, D]

        feat_s0, feat_s1 = high_res
        up1, norm, act1, up2, act2 = self.output_upscaling
        hyper_in = torch.stack(
            [mlp(mask_tokens_out[:, i]) for i, mlp in enumerate(self.output_hypernetworks_mlps)],
            dim=1,
        )  # [P, 4, D/8]
        if self.fused_upscale and runs_triton(image.device):
            masks = upscale_masks(
                image_tokens, up1.weight, up1.bias, norm.weight, norm.bias, feat_s1,
                up2.weight, up2.bias, feat_s0, hyper_in, h, w, norm.eps,
            )  # fmt: skip
        else:
            x = image_tokens.transpose(1, 2).reshape(P, D, h, w)
            x = act1(norm(up1(x) + feat_s1))
            x = act2(up2(x) + feat_s0)  # [P, D/8, 4h, 4w]
            _, c, H, W = x.shape
            masks = (hyper_in @ x.reshape(P, c, H * W)).reshape(P, -1, H, W)
        iou = torch.sigmoid(self.iou_prediction_head(iou_token_out))
        return masks, iou, self.pred_obj_score_head(obj_token_out)


def select_masks(
    masks: Tensor, iou: Tensor, multimask: bool, delta: float, thresh: float
) -> tuple[Tensor, Tensor]:
    """The answer from all four tokens: `[P, 3, H, W]`/`[P, 3]` multimask, else `[P, 1, ..]`.

    A single-mask answer is kept where it is stable (the areas above +delta and above
    -delta have IoU >= thresh); elsewhere the multimask candidate with the best predicted
    IoU replaces it, so an ambiguous click still gets a sensible mask.
    """
    if multimask:
        return masks[:, 1:], iou[:, 1:]
    single, single_iou = masks[:, :1], iou[:, :1]
    flat = single.flatten(-2)
    inter = (flat > delta).sum(-1).float()
    union = (flat > -delta).sum(-1).float()
    stable = torch.where(union > 0, inter / union, torch.ones_like(inter)) >= thresh  # [P, 1]
    best = iou[:, 1:].argmax(dim=1)  # [P]
    rows = torch.arange(masks.shape[0], device=masks.device)
    best_mask = masks[:, 1:][rows, best].unsqueeze(1)
    best_iou = iou[:, 1:][rows, best].unsqueeze(1)
    return (
        torch.where(stable[..., None, None], single, best_mask),
        torch.where(stable, single_iou, best_iou),
    )
