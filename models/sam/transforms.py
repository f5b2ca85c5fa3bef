"""Pre- and post-processing for SAM on tensors (CPU or GPU, no PIL, no numpy).

Pre-processing resizes each image so its longest side is the model's input size (Meta's
rounding), normalizes it and zero-pads it bottom/right into one `[B, 3, S, S]` batch.
Images of different sizes can arrive as one jagged nested tensor of flattened pixels, so
the host-to-device copy is a single buffer. Resizing runs on floats with antialiasing,
the tensor counterpart of the PIL resize in Meta's `ResizeLongestSide.apply_image`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from models.images import Size, normalizer, split_images
from models.sam.config import SamConfig

__all__ = [
    "masks_from_logits",
    "postprocess_masks",
    "preprocess_images",
    "resize_longest_side_size",
    "scale_boxes",
    "scale_coords",
]


def resize_longest_side_size(h: int, w: int, target: int) -> Size:
    """(newh, neww) with the longest side at `target`, rounded as Meta rounds (x + 0.5)."""
    scale = target * 1.0 / max(h, w)
    return int(h * scale + 0.5), int(w * scale + 0.5)


def preprocess_images(
    images: Sequence[Tensor] | Tensor,
    config: SamConfig,
    device: torch.device | str,
    sizes: Sequence[Size] | None = None,
) -> tuple[Tensor, list[Size]]:
    """uint8 images -> (`[B, 3, S, S]` float32 normalized, zero-padded batch, input sizes).

    images: a list of `[H, W, 3]` uint8 tensors, or a jagged nested tensor `[B, j, 3]`
    (j = H*W) with `sizes` giving each (H, W). The input sizes `(newh, neww)` returned are
    the resized extents inside the padded square, needed to crop masks afterwards.
    """
    S = config.image_size
    views = split_images(images, sizes)
    mean, std = normalizer(str(device), config.pixel_mean, config.pixel_std)
    batch = torch.zeros(len(views), 3, S, S, device=device)
    input_sizes: list[Size] = []
    for k, image in enumerate(views):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(
                f"image {k}: expected uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}"
            )
        h, w = int(image.shape[0]), int(image.shape[1])
        newh, neww = resize_longest_side_size(h, w, S)
        x = image.to(device, non_blocking=True).permute(2, 0, 1).float()  # [3, H, W]
        if (newh, neww) != (h, w):
            x = F.interpolate(
                x[None], (newh, neww), mode="bilinear", align_corners=False, antialias=True
            )[0]
        batch[k, :, :newh, :neww] = (x - mean) / std
        input_sizes.append((newh, neww))
    return batch, input_sizes


def postprocess_masks(
    low_res: Tensor, input_size: Size, original_size: Size, config: SamConfig
) -> Tensor:
    """Low-res logits `[P, C, m, m]` -> logits `[P, C, H, W]` at the original image size.

    Upscale to the padded input square, crop the padding away, resize to the original
    size (bilinear, as Meta's `Sam.postprocess_masks`).
    """
    S = config.image_size
    masks = F.interpolate(low_res, (S, S), mode="bilinear", align_corners=False)
    masks = masks[..., : input_size[0], : input_size[1]]
    return F.interpolate(masks, tuple(original_size), mode="bilinear", align_corners=False)


def masks_from_logits(logits: Tensor, config: SamConfig) -> Tensor:
    """Binary masks (bool, same shape) from mask logits, at the config's threshold."""
    return logits > config.mask_threshold


@overload
def scale_coords(coords: Tensor, original_size: Size, config: SamConfig) -> Tensor: ...
@overload
def scale_coords(coords: np.ndarray, original_size: Size, config: SamConfig) -> np.ndarray: ...
def scale_coords(
    coords: Tensor | np.ndarray, original_size: Size, config: SamConfig
) -> Tensor | np.ndarray:
    """Points `[..., 2]` (x, y) in original pixels -> the model input frame (float32).

    x scales by neww / W and y by newh / H, as Meta's `ResizeLongestSide.apply_coords`.
    A numpy array in gives one out: the GPU worker scales every served prompt this way,
    where a handful of small torch ops per prompt cost it four times the host time.
    """
    h, w = original_size
    newh, neww = resize_longest_side_size(h, w, config.image_size)
    # float64 product then float32, as Meta's numpy path (astype(float)) computes it
    if isinstance(coords, np.ndarray):
        return (coords.astype(np.float64) * np.array([neww / w, newh / h])).astype(np.float32)
    scale = torch.tensor([neww / w, newh / h], dtype=torch.float64, device=coords.device)
    return (coords.to(torch.float64) * scale).to(torch.float32)


def scale_boxes(boxes: Tensor, original_size: Size, config: SamConfig) -> Tensor:
    """Boxes `[..., 4]` (x0, y0, x1, y1) in original pixels -> the model input frame."""
    corners = scale_coords(boxes.reshape(*boxes.shape[:-1], 2, 2), original_size, config)
    return corners.reshape(boxes.shape)
