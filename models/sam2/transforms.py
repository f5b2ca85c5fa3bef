"""SAM 2's pre- and post-processing: a square resize (no letterbox), ImageNet normalisation.

Unlike SAM, SAM 2 stretches every image to `image_size x image_size` (aspect ratio not
kept), so prompts scale by (S / W, S / H) and masks come back with one bilinear resize
from the low-resolution logits straight to the original size, with no padding to crop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from models.images import Size, normalizer, split_images
from models.sam2.config import Sam2Config

__all__ = [
    "postprocess_masks",
    "preprocess_image",
    "preprocess_images",
    "scale_boxes",
    "scale_points",
]


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


def preprocess_images(
    images: Sequence[Tensor] | Tensor,
    config: Sam2Config,
    device: torch.device | str,
    sizes: Sequence[Size] | None = None,
) -> Tensor:
    """uint8 images of any sizes -> one normalised `[B, 3, S, S]` fp32 batch on `device`.

    images: `[H, W, 3]` uint8 tensors, or a jagged nested `[B, j, 3]` tensor with `sizes`
    (as `models.sam.transforms.preprocess_images` takes them). Each image goes through the
    same steps as `preprocess_image` (so the served batch equals the one-image reference),
    on the device; with no padding, every image fills its square.
    """
    S = config.image_size
    views = split_images(images, sizes)
    mean, std = normalizer(str(device), config.pixel_mean, config.pixel_std)
    batch = torch.empty(len(views), 3, S, S, device=device)
    for k, image in enumerate(views):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(
                f"image {k}: expected uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}"
            )
        x = image.to(device, non_blocking=True).permute(2, 0, 1)[None].float() / 255.0
        if tuple(x.shape[2:]) != (S, S):
            x = F.interpolate(x, (S, S), mode="bilinear", align_corners=False, antialias=True)
        batch[k] = (x[0] - mean) / std
    return batch


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
