"""The data that flows through automatic mask generation (see `models.sam.automatic`).

Settings (Meta's `SamAutomaticMaskGenerator` arguments), one crop's plan, its embedding,
the filtered candidates of one decoder chunk, and the final masks. Tensors live on the
model's device; host-side values (boxes, sizes) are plain ints so that planning and
bookkeeping never wait for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch import Tensor

from models.images import Size
from models.sam.automatic_ops import Box

__all__ = [
    "AutomaticMaskSettings",
    "AutomaticMasks",
    "CropEmbedding",
    "CropJob",
    "MaskCandidates",
]


@dataclass(frozen=True)
class AutomaticMaskSettings:
    """Meta's `SamAutomaticMaskGenerator` arguments (same names, defaults and meaning), plus
    two that bound memory: `max_work_bytes` (temporaries of upscaling and region clean-up;
    one mask at a time is the floor) and `max_masks` (keep at most this many masks, best
    predicted IoU first; None keeps all, as Meta does).
    """

    points_per_side: int = 32
    points_per_batch: int = 64
    pred_iou_thresh: float = 0.88
    stability_score_thresh: float = 0.95
    stability_score_offset: float = 1.0
    box_nms_thresh: float = 0.7
    crop_n_layers: int = 0
    crop_nms_thresh: float = 0.7
    crop_overlap_ratio: float = 512 / 1500
    crop_n_points_downscale_factor: int = 1
    min_mask_region_area: int = 0
    max_work_bytes: int = 256 * 2**20
    max_masks: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.points_per_side >= 1, "points_per_side must be >= 1"),
            (self.points_per_batch >= 1, "points_per_batch must be >= 1"),
            (self.crop_n_layers >= 0, "crop_n_layers must be >= 0"),
            (self.crop_n_points_downscale_factor >= 1, "crop_n_points_downscale_factor >= 1"),
            (self.min_mask_region_area >= 0, "min_mask_region_area must be >= 0"),
            (self.max_work_bytes >= 1, "max_work_bytes must be >= 1"),
            (self.max_masks is None or self.max_masks >= 1, "max_masks must be None or >= 1"),
            (0.0 <= self.crop_overlap_ratio < 1.0, "crop_overlap_ratio must be in [0, 1)"),
            (self.stability_score_offset >= 0, "stability_score_offset must be >= 0"),
        ]
        for name in (
            "pred_iou_thresh",
            "stability_score_thresh",
            "box_nms_thresh",
            "crop_nms_thresh",
        ):
            value = getattr(self, name)
            checks.append((math.isfinite(value) and 0.0 <= value <= 1.0, f"{name} in [0, 1]"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True, eq=False)
class CropJob:
    """One crop of the plan: where it is, its prompts, and how many decoder chunks it takes.

    index: position in the plan; layer: 0 for the full image, i for the (2^i)^2 crops of
    layer i; box: (x0, y0, x1, y1) in original pixels (x1, y1 exclusive); input_size: the
    crop resized inside the model's square input. input_points `[n, 2]` float32 (model input
    frame) and point_coords `[n, 2]` float32 (original pixels) live on the model's device.
    """

    index: int
    layer: int
    box: Box
    original_size: Size
    input_size: Size
    input_points: Tensor
    point_coords: Tensor
    points_per_batch: int

    @property
    def crop_size(self) -> Size:
        x0, y0, x1, y1 = self.box
        return y1 - y0, x1 - x0

    @property
    def is_full_image(self) -> bool:
        return self.box == (0, 0, self.original_size[1], self.original_size[0])

    @property
    def num_points(self) -> int:
        return self.input_points.shape[0]

    @property
    def num_chunks(self) -> int:
        return -(-self.num_points // self.points_per_batch)


E = TypeVar("E")


@dataclass(frozen=True, eq=False)
class CropEmbedding(Generic[E]):
    """What the model's encode gave for job `crop`, in the model's dtype (SAM: the
    `[1, C, h, w]` embedding; SAM 2: `Sam2Features` of batch 1)."""

    crop: int
    embedding: E


@dataclass(frozen=True, eq=False)
class MaskCandidates:
    """The masks of one decoder chunk that passed every per-mask filter (K of them).

    low_res `[K, m, m]` decoder logits (model dtype), scores `[K]` predicted IoU, stability
    `[K]` (float32), boxes `[K, 4]` int64 XYXY in the crop frame (inclusive max corners, as
    Meta's), point_coords `[K, 2]` float32 original pixels. All on the model's device.
    """

    job: CropJob
    low_res: Tensor
    scores: Tensor
    stability: Tensor
    boxes: Tensor
    point_coords: Tensor

    def __len__(self) -> int:
        return self.scores.shape[0]


@dataclass(frozen=True, eq=False)
class AutomaticMasks:
    """Final masks of one image, on the device, sorted by predicted IoU (best first; ties keep
    Meta's output order).

    masks `[N, H, W]` bool; scores `[N]` predicted IoU and stability `[N]` float32; boxes
    `[N, 4]` int64 XYWH (w = max x - min x, as Meta's `bbox`); areas `[N]` int64 pixel counts;
    point_coords `[N, 2]` float32 (the prompt, original pixels); crop_boxes `[N, 4]` int64 XYWH.
    """

    masks: Tensor
    scores: Tensor
    stability: Tensor
    boxes: Tensor
    areas: Tensor
    point_coords: Tensor
    crop_boxes: Tensor

    def __len__(self) -> int:
        return self.scores.shape[0]
