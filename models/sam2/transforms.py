"""SAM 2's pre- and post-processing: a square resize (no letterbox), ImageNet normalisation.

Unlike SAM, SAM 2 stretches every image to `image_size x image_size` (aspect ratio not
kept), so prompts scale by (S / W, S / H) and masks come back with one bilinear resize
from the low-resolution logits straight to the original size, with no padding to crop.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from models.sam2.config import Sam2Config

__all__ = ["postprocess_masks", "preprocess_image", "scale_boxes", "scale_points"]


def preprocess_image(image: np.ndarray, config: Sam2Config) -> Tensor:
    """uint8 RGB `[H, W, 3]` -> normalised `[1, 3, S, S]` fp32.

    Bilinear with antialiasing, on [0, 1] floats: what torchvision's `Resize` does to a
    tensor, which is what Meta's transforms run after `ToTensor`.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 RGB image [H, W, 3], got {image.dtype} {image.shape}")
    if not image.flags.writeable:  # torch warns on read-only arrays (e.g. np.asarray(PIL))
        image = image.copy()
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float() / 255.0
    size = config.image_size
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    mean = torch.tensor(config.pixel_mean).reshape(1, 3, 1, 1)
    std = torch.tensor(config.pixel_std).reshape(1, 3, 1, 1)
    return (x - mean) / std


def scale_points(points: Tensor, original_hw: tuple[int, int], config: Sam2Config) -> Tensor:
    """Original-image pixels `[..., 2]` (x, y) -> model-input pixels."""
    h, w = original_hw
    # normalise first, then scale: the order of Meta's `transform_coords`, bit for bit
    size = torch.tensor([float(w), float(h)], device=points.device)
    return points.float() / size * config.image_size


def scale_boxes(boxes: Tensor, original_hw: tuple[int, int], config: Sam2Config) -> Tensor:
    """Original-image boxes `[P, 4]` (x0, y0, x1, y1) -> model-input pixels."""
    return scale_points(boxes.reshape(-1, 2, 2), original_hw, config).reshape(-1, 4)


def postprocess_masks(
    low_res: Tensor, original_hw: tuple[int, int], config: Sam2Config
) -> tuple[Tensor, Tensor]:
    """Low-res logits `[P, M, 4h, 4w]` -> (masks `[P, M, H, W]` bool, logits clamped to
    [-32, 32] at low resolution, as Meta returns them for the next round's `mask_input`)."""
    up = F.interpolate(low_res.float(), original_hw, mode="bilinear", align_corners=False)
    return up > config.mask_threshold, low_res.clamp(-32.0, 32.0)
