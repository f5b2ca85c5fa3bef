"""The SAM model: a batched `encode` for images and a batched `decode` for prompt sets.

Module and parameter names mirror Meta's `segment_anything.modeling.Sam`, so its official
state dicts load with strict key checking. Unlike Meta's `forward`, nothing here holds a
per-image state: embeddings are passed in, and one `decode` call serves prompt sets from
many images (`PromptBatch.image_index` picks each set's embedding on the device, or the
caller passes one embedding row per set).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.sam.config import SamConfig
from models.sam.image_encoder import ImageEncoderViT
from models.sam.mask_decoder import MaskDecoder
from models.sam.prompt_encoder import PromptEncoder
from models.sam.prompts import PromptBatch

__all__ = ["Sam"]


class Sam(nn.Module):
    """Segment Anything for inference; see `encode` and `decode`."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.config = config
        self.image_encoder = ImageEncoderViT(config)
        self.prompt_encoder = PromptEncoder(config)
        self.mask_decoder = MaskDecoder(config)
        # Not persistent, as in Meta's model: the official checkpoints do not hold them.
        self.register_buffer("pixel_mean", torch.empty(3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.empty(3, 1, 1), persistent=False)
        self.pixel_mean: Tensor
        self.pixel_std: Tensor
        self.reset_constant_buffers()

    def reset_constant_buffers(self) -> None:
        """Fill the non-persistent buffers from the config (needed after a meta-device build)."""
        device = self.pixel_mean.device if self.pixel_mean.device.type != "meta" else "cpu"
        self.pixel_mean = torch.tensor(self.config.pixel_mean, device=device).view(3, 1, 1)
        self.pixel_std = torch.tensor(self.config.pixel_std, device=device).view(3, 1, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.mask_decoder.iou_token.weight.dtype

    def encode(self, images: Tensor) -> Tensor:
        """images `[B, 3, S, S]` (normalized, zero-padded) -> embeddings `[B, 256, S/16, S/16]`."""
        size = self.config.image_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise ValueError(f"encode expects [B, 3, {size}, {size}], got {tuple(images.shape)}")
        return self.image_encoder(images.to(self.dtype))

    def decode(self, embeddings: Tensor, prompts: PromptBatch) -> tuple[Tensor, Tensor]:
        """Decode P prompt sets against B image embeddings in one pass.

        embeddings: `[B, 256, h, w]`; prompts: P sets, `prompts.image_index [P]` in [0, B),
        or None with B == P: row p is set p's embedding, used as is (gathering the rows
        again would copy ~2 MB per set at 1024 px in half precision).
        Returns low-res mask logits `[P, 4, 4h, 4w]` and IoU predictions `[P, 4]`; index 0
        is the single-mask output, 1..3 the multimask outputs (slice as Meta's decoder).
        """
        h, w = self.prompt_encoder.image_embedding_size
        if embeddings.ndim != 4 or tuple(embeddings.shape[2:]) != (h, w):
            raise ValueError(f"decode expects [B, C, {h}, {w}], got {tuple(embeddings.shape)}")
        if prompts.mask_input is not None and tuple(prompts.mask_input.shape[2:]) != (4 * h, 4 * w):
            got = tuple(prompts.mask_input.shape)
            raise ValueError(f"mask_input must be [P, 1, {4 * h}, {4 * w}], got {got}")
        dtype = self.dtype
        tokens = self.prompt_encoder.embed_tokens(prompts.points, prompts.point_labels)
        dense = self.prompt_encoder.embed_dense(
            prompts.mask_input, prompts.has_mask_input, prompts.num_sets
        )  # [P, D, h, w]
        image = embeddings.to(dtype)  # [B, D, h, w]
        if prompts.image_index is not None:
            image = image.index_select(0, prompts.image_index)  # [P, D, h, w]
        elif image.shape[0] != prompts.num_sets:
            raise ValueError(
                f"without image_index, decode needs one embedding per prompt set: "
                f"{image.shape[0]} embeddings for {prompts.num_sets} sets"
            )
        image = image + dense
        image_pe = self.prompt_encoder.dense_pe().to(dtype)  # [1, D, h, w]
        return self.mask_decoder(image, image_pe, tokens.to(dtype), prompts.token_valid)
