"""The image path of SAM 2.1: encode an image once, then decode any number of prompts.

What Meta's `SAM2ImagePredictor` does with a `SAM2Base`, without the video machinery:
- encode: Hiera + FPN; the stride-16 level plus the learned `no_mem_embed` is the image
  embedding (SAM 2 was trained so that a frame without memories gets this constant
  instead of memory attention: `directly_add_no_mem_embed`); the stride-4 and stride-8
  levels, projected by the decoder's `conv_s0`/`conv_s1`, are the high-res features;
- decode: SAM's prompt encoder (box corners are point tokens with labels 2 and 3, placed
  before the clicks; a not-a-point token ends every point list) and SAM 2's mask decoder.
Nothing here is stateful: features are returned to the caller, who may cache them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.sam.prompt_encoder import (
    LABEL_BOX_BR,
    LABEL_BOX_TL,
    LABEL_NOT_A_POINT,
    LABEL_PAD,
    PromptEncoder,
)
from models.sam.prompts import PromptBatch
from models.sam.transformer import use_fused_attention
from models.sam2.config import Sam2Config
from models.sam2.image_encoder import ImageEncoder
from models.sam2.mask_decoder import Sam2MaskDecoder, select_masks
from models.triton_device import runs_triton

__all__ = ["Sam2", "Sam2Encoder", "Sam2Features", "Sam2Prediction", "default_decoder_paths"]


def default_decoder_paths(device: torch.device) -> dict[str, bool]:
    """`Sam2.use_decoder_paths`' arguments that paid off where measured.

    On an H100 in TF32 (docs/BENCHMARKS.md, issue 24's eleventh session), segment
    everything's decoder took 116 ms per photo plainly, 90 with the attention kernel and
    105 with one shared image row. Sharing the image row is plain PyTorch with equal
    answers, so it is on everywhere. The upscale kernel's first forms lost to inductor (161
    ms); its third (twenty-second session) takes 5.1-5.3 ms a call of 256 prompt sets
    against inductor's 7.3 and made segment everything 125 -> 111 ms a photo at the same
    mIoU. The kernels run only where they compile (CUDA), not under the CPU's interpreter.
    """
    on_gpu = device.type == "cuda" and runs_triton(device)
    return {"fused_upscale": on_gpu, "fused_attention": on_gpu, "share_image": True}


@dataclass(frozen=True)
class Sam2Features:
    """What one encode yields per image: everything a decode needs."""

    image_embed: Tensor  # [B, D, h, w], no_mem_embed added
    high_res: tuple[Tensor, Tensor]  # projected s0 [B, D/8, 4h, 4w], s1 [B, D/4, 2h, 2w]

    def select(self, index: int) -> Sam2Features:
        """One image's features, batch dimension kept (`[1, ...]`)."""
        s0, s1 = self.high_res
        sl = slice(index, index + 1)
        return Sam2Features(self.image_embed[sl], (s0[sl], s1[sl]))


@dataclass(frozen=True)
class Sam2Prediction:
    """Low-resolution mask logits `[P, M, 4h, 4w]`, IoU `[P, M]`, object logits `[P, 1]`."""

    low_res_masks: Tensor
    iou: Tensor
    object_logits: Tensor


class Sam2(nn.Module):
    """Image encoder, prompt encoder, mask decoder and `no_mem_embed`, under Meta's names."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.config = config
        self.image_encoder = ImageEncoder(config)
        self.sam_prompt_encoder = PromptEncoder(config.prompt_config())
        self.sam_mask_decoder = Sam2MaskDecoder(config)
        self.no_mem_embed = nn.Parameter(torch.zeros(1, 1, config.d_model))
        # Prompt sets on one image without mask inputs see the same image tokens until the
        # first image-to-token attention: with this set, `decode` hands the decoder one row
        # of them, and the first layer's image-side projections run once, not once per set
        # (`default_decoder_paths` says what it saved).
        self.share_image = True

    @property
    def dtype(self) -> torch.dtype:
        return self.no_mem_embed.dtype

    def use_decoder_paths(
        self, *, fused_upscale: bool, fused_attention: bool, share_image: bool
    ) -> None:
        """The decoder's paths, each on or off: `Sam2MaskDecoder.fused_upscale`, the
        attention kernel (`Attention.fused`) and `share_image` (`default_decoder_paths`
        says which pay off)."""
        self.sam_mask_decoder.fused_upscale = fused_upscale
        use_fused_attention(self.sam_mask_decoder, fused_attention)
        self.share_image = share_image

    def encode(self, images: Tensor) -> Sam2Features:
        """images `[B, 3, S, S]`, normalised (see `transforms.preprocess_image`)."""
        size = self.config.image_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise ValueError(f"encode expects [B, 3, {size}, {size}], got {tuple(images.shape)}")
        decoder = self.sam_mask_decoder
        embed, s0, s1 = _encode(
            self.image_encoder, decoder.conv_s0, decoder.conv_s1, self.no_mem_embed,
            images.to(self.dtype),
        )  # fmt: skip
        return Sam2Features(image_embed=embed, high_res=(s0, s1))

    def decode(
        self,
        features: Sam2Features,
        points: Tensor | None,
        labels: Tensor | None,
        boxes: Tensor | None = None,
        mask_input: Tensor | None = None,
        multimask: bool = True,
    ) -> Sam2Prediction:
        """P prompt sets on one image (features of batch 1) or on P images (batch P).

        points `[P, N, 2]` and boxes `[P, 4]` (x0, y0, x1, y1) in model-input pixels;
        labels `[P, N]` (1 positive, 0 negative); mask_input `[P, 1, 4h, 4w]` logits.
        """
        tokens = self._sparse_tokens(points, labels, boxes, mask_input)  # [P, T, D]
        P = tokens.shape[0]
        encoder = self.sam_prompt_encoder
        has_mask = None if mask_input is None else mask_input.new_ones(P, dtype=torch.bool)
        dense = encoder.embed_dense(mask_input, has_mask, P)  # [P, D, h, w]
        if self.share_image and mask_input is None and features.image_embed.shape[0] == 1:
            image = features.image_embed + dense[:1]  # [1, D, h, w]: the same for every set
        else:
            image = features.image_embed.expand(P, -1, -1, -1) + dense
        valid = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        masks, iou, obj = self.sam_mask_decoder(
            image,
            encoder.dense_pe().to(image.dtype),  # computed in fp32, as positions must be
            features.high_res,
            tokens.to(image.dtype),
            valid,
        )
        cfg = self.config
        masks, iou = select_masks(masks, iou, multimask, cfg.stability_delta, cfg.stability_thresh)
        return Sam2Prediction(low_res_masks=masks, iou=iou, object_logits=obj)

    def decode_batch(
        self, features: Sam2Features, prompts: PromptBatch
    ) -> tuple[Tensor, Tensor, Tensor]:
        """P prompt sets of many requests against B images' features in one decoder call.

        prompts: `models.sam.pack_prompts`'s batch (the same one SAM decodes), with
        `image_index [P]` into the B images, or None when the features are one row per set.
        Returns all four tokens' low-res logits `[P, 4, 4h, 4w]`, IoU `[P, 4]` and object
        logits `[P, 1]`; `select_masks` gives the multimask or single-mask answer per set.

        SAM 2 differs from SAM in one canonical token: its predictor appends a not-a-point
        token to every non-empty prompt, a box's too, where `pack_prompts` (SAM's rule) adds
        it only without a box. It is appended here as one more column, valid only in sets
        with a box, decided on the device (no host round trip). SAM 2 also puts the box
        before the clicks; token order changes nothing but rounding, since every attention
        over tokens is permutation-equivariant and the tokens carry their own positions.
        """
        labels = prompts.point_labels
        has_box = (labels == LABEL_BOX_TL).any(dim=1, keepdim=True)  # [P, 1]
        extra = torch.where(
            has_box,
            torch.full_like(has_box, LABEL_NOT_A_POINT, dtype=labels.dtype),
            torch.full_like(has_box, LABEL_PAD, dtype=labels.dtype),
        )
        labels = torch.cat([labels, extra], dim=1)  # [P, T + 1]
        points = torch.cat([prompts.points, prompts.points.new_zeros(labels.shape[0], 1, 2)], 1)
        valid = torch.cat([prompts.token_valid, has_box], dim=1)

        encoder = self.sam_prompt_encoder
        P = labels.shape[0]
        tokens = encoder.embed_tokens(points, labels)  # [P, T + 1, D] fp32
        dense = encoder.embed_dense(prompts.mask_input, prompts.has_mask_input, P)
        embed, (s0, s1) = features.image_embed, features.high_res
        if prompts.image_index is not None:
            # high-res rows are gathered too: one copy per set, as for the embedding
            index = prompts.image_index
            embed, s0, s1 = embed[index], s0[index], s1[index]
        elif embed.shape[0] != P:
            raise ValueError(
                f"without image_index, decode_batch needs one image per prompt set: "
                f"{embed.shape[0]} images for {P} sets"
            )
        return self.sam_mask_decoder(
            embed + dense,
            encoder.dense_pe().to(embed.dtype),
            (s0, s1),
            tokens.to(embed.dtype),
            valid,
        )

    def _sparse_tokens(
        self,
        points: Tensor | None,
        labels: Tensor | None,
        boxes: Tensor | None,
        mask_input: Tensor | None,
    ) -> Tensor:
        """Box corners, then clicks, then one not-a-point token; none at all for a mask alone."""
        coords: list[Tensor] = []
        kinds: list[Tensor] = []
        if boxes is not None:
            corners = torch.tensor([LABEL_BOX_TL, LABEL_BOX_BR], device=boxes.device)
            coords.append(boxes.reshape(-1, 2, 2).float())
            kinds.append(corners.expand(boxes.shape[0], 2))
        if points is not None:
            if labels is None or labels.shape != points.shape[:2]:
                raise ValueError("labels must be given with points, shaped [P, N]")
            coords.append(points.float())
            kinds.append(labels.long())
        if not coords:
            if mask_input is None:
                raise ValueError("a prompt needs points, a box or a mask input")
            P = mask_input.shape[0]
            return mask_input.new_zeros(P, 0, self.config.d_model, dtype=torch.float32)
        xy = torch.cat(coords, dim=1)
        lab = torch.cat(kinds, dim=1)
        # Meta pads every point list with a not-a-point token (its prompt encoder is always
        # called without a separate box): it changes the answer, so it is kept.
        xy = torch.cat([xy, xy.new_zeros(xy.shape[0], 1, 2)], dim=1)
        lab = torch.cat([lab, lab.new_full((lab.shape[0], 1), LABEL_NOT_A_POINT)], dim=1)
        return self.sam_prompt_encoder.embed_tokens(xy, lab)


class Sam2Encoder(nn.Module):
    """`Sam2.encode` as a module of tensors: `[B, 3, S, S]` -> the embedding
    `[B, D, h, w]`, s0 `[B, D/8, 4h, 4w]` and s1 `[B, D/4, 2h, 2w]`.

    Why: torch.export and an AOT package (`SERVE_COMPILE_MODE=aot`, `models.aot`) take a
    module with tensors out, and this one holds only what encoding reads (Hiera and its
    neck, the decoder's two high-res projections, `no_mem_embed`): a package carries none
    of the decoder's weights, and its key's weights hash is the encoder's. The submodules
    are the model's own, not copies; `Sam2.encode` computes the same `_encode`.
    """

    def __init__(self, model: Sam2) -> None:
        super().__init__()
        self.image_encoder = model.image_encoder
        self.conv_s0 = model.sam_mask_decoder.conv_s0
        self.conv_s1 = model.sam_mask_decoder.conv_s1
        self.no_mem_embed = model.no_mem_embed

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _encode(self.image_encoder, self.conv_s0, self.conv_s1, self.no_mem_embed, images)


def _encode(
    image_encoder: nn.Module, conv_s0: nn.Module, conv_s1: nn.Module, no_mem_embed: Tensor,
    images: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The embedding, s0 and s1 (`Sam2Encoder`): the stride-16 level plus `no_mem_embed`,
    and the stride-4 and stride-8 levels projected to the decoder's upscaling widths, once
    per image rather than on every click."""
    fpn = image_encoder(images).features  # strides 4, 8, 16
    embed = fpn[-1] + no_mem_embed.reshape(1, -1, 1, 1)
    return embed, conv_s0(fpn[0]), conv_s1(fpn[1])
