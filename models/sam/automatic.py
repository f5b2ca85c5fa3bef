"""SAM's automatic mask generation ("segment everything") as a batched, device-resident pipeline.

It produces what Meta's `SamAutomaticMaskGenerator` produces (a grid of single-point
prompts per crop, predicted-IoU and stability filters, masks cut by a crop border dropped,
box NMS per crop, NMS across crops preferring smaller crops, optional small-region
clean-up), written on tensors so that it runs on any device and only the final masks need
to leave it. It is split into steps so that the service can run other GPU work between
them (an interactive request never waits for a whole image):

    jobs = generator.plan((H, W))                           # host only: crops, point grids
    for job in jobs:
        emb = generator.encode_crop(image, job)             # one encoder call (or a cached
                                                            # embedding: `embedding_for`)
        per_crop.append([generator.decode_chunk(emb, job, c) for c in range(job.num_chunks)])
    result = generator.finish(per_crop, (H, W))             # NMS, clean-up, full-res masks

Memory stays bounded: a chunk decodes `points_per_batch` prompts; candidates keep their
low-res logits (`[m, m]`, m = 4x the embedding side), never a full-resolution mask; the
crop-resolution logits that the stability score and the boxes need (computed exactly as
Meta computes them) are built in slices of at most `max_work_bytes` and dropped; only the
survivors of NMS are upscaled again at the end. `estimate_peak_bytes` bounds the total, so
the service can refuse a request instead of running out of memory.

The model-independent steps live in `models.sam.automatic_pipeline.GridMaskGenerator`
(SAM 2's generator shares them); this module gives them SAM's encode, decode and upscaling.

Host syncs (each a device->host wait): `decode_chunk` two (compaction after the IoU
filter, and after the stability and crop-edge filters; the first is skipped when
`pred_iou_thresh <= 0`); `finish` two per NMS (convergence check, compaction; two NMS with
crops, one without), one to group survivors by chunk, and with `min_mask_region_area` a few
per slice of masks (connected-component convergence) plus one more NMS.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.images import Size
from models.sam.automatic_memory import estimate_peak_bytes, upscale_bytes
from models.sam.automatic_pipeline import GridMaskGenerator
from models.sam.automatic_types import (
    AutomaticMasks,
    AutomaticMaskSettings,
    CropEmbedding,
    CropJob,
    MaskCandidates,
)
from models.sam.config import SamConfig
from models.sam.prompt_encoder import LABEL_NOT_A_POINT
from models.sam.prompts import PromptBatch
from models.sam.sam import Sam
from models.sam.transformer import decoder_attention
from models.sam.transforms import (
    postprocess_masks,
    preprocess_images,
    resize_longest_side_size,
    scale_coords,
)

__all__ = [
    "AutomaticMaskGenerator",
    "AutomaticMaskSettings",
    "AutomaticMasks",
    "CropEmbedding",
    "CropJob",
    "GridMaskGenerator",
    "MaskCandidates",
    "estimate_peak_bytes",
    "single_point_prompts",
]


def single_point_prompts(points: Tensor) -> PromptBatch:
    """P one-point prompts on image 0, built on the points' device: `[P, 2]` -> `PromptBatch`.

    The tokens are those `pack_prompts` makes for a points-only set (the point with label 1,
    then a "not a point" token at (0, 0)), without a host round trip per prompt.
    """
    P = points.shape[0]
    device = points.device
    coords = torch.stack([points.float(), torch.zeros_like(points, dtype=torch.float32)], dim=1)
    labels = torch.ones(P, 2, dtype=torch.int64, device=device)
    labels[:, 1] = LABEL_NOT_A_POINT
    return PromptBatch(
        image_index=torch.zeros(P, dtype=torch.int64, device=device),
        points=coords,  # [P, 2, 2]
        point_labels=labels,  # [P, 2]
        token_valid=torch.ones(P, 2, dtype=torch.bool, device=device),
    )


class AutomaticMaskGenerator(GridMaskGenerator[Tensor]):
    """Segment everything in an image with a SAM model; see the module docstring for the steps.

    The crop embedding is `Sam.encode`'s `[1, C, h, w]`.
    """

    def __init__(self, model: Sam, settings: AutomaticMaskSettings | None = None) -> None:
        self.model = model
        self.config: SamConfig = model.config
        self.settings = settings if settings is not None else AutomaticMaskSettings()

    @property
    def device(self) -> torch.device:
        return self.model.pixel_mean.device

    @property
    def mask_threshold(self) -> float:
        return self.config.mask_threshold

    def estimate_peak_bytes(self, original_size: Size) -> int:
        """`estimate_peak_bytes` for this model (its dtype) and these settings."""
        return estimate_peak_bytes(self.config, self.settings, original_size, self.model.dtype)

    def _input_size(self, crop_size: Size) -> Size:
        return resize_longest_side_size(*crop_size, self.config.image_size)

    def _input_points(self, points: Tensor, crop_size: Size) -> Tensor:
        return scale_coords(points, crop_size, self.config)

    def _encode(self, crop: Tensor, job: CropJob) -> Tensor:
        batch, sizes = preprocess_images([crop], self.config, self.device)
        if sizes[0] != job.input_size:
            raise RuntimeError(f"crop resized to {sizes[0]}, planned {job.input_size}")
        return self.model.encode(batch)  # [1, C, h, w]

    def _check_embedding(self, embedding: Tensor) -> Tensor:
        """embedding: `[1, C, h, w]` or `[C, h, w]`, from `Sam.encode` of the whole image."""
        if embedding.ndim == 3:
            embedding = embedding[None]
        side = self.config.embedding_size
        expected = (1, self.config.prompt_embed_dim, side, side)
        if tuple(embedding.shape) != expected:
            raise ValueError(f"embedding must be {expected}, got {tuple(embedding.shape)}")
        return embedding.to(self.device, non_blocking=True)

    def _decode(self, embedding: Tensor, points: Tensor) -> tuple[Tensor, Tensor]:
        """SAM's three multimask outputs per point (the single-mask token is dropped)."""
        with decoder_attention(embedding.dtype):
            low_res, iou = self.model.decode(embedding, single_point_prompts(points))
        return low_res[:, 1:], iou[:, 1:]  # [n, 3, m, m], [n, 3]

    def _upscale(self, low_res: Tensor, job: CropJob) -> Tensor:
        logits = postprocess_masks(
            low_res[:, None].float(), job.input_size, job.crop_size, self.config
        )
        return logits[:, 0]

    def _upscale_bytes(self, crop_size: Size) -> int:
        return upscale_bytes(self.config, crop_size)
