"""Swin pre-processing on tensors (CPU or GPU, no PIL): timm's eval transform.

timm evaluates these models with `Resize(int(S / crop_pct), bicubic)` on the shorter
side, `CenterCrop(S)`, `ToTensor()` and ImageNet normalization, on PIL images. Here the
same steps run on uint8 `[H, W, 3]` tensors. `F.interpolate(mode="bicubic",
antialias=True)` uses PIL's antialiased cubic kernel (a = -0.5); like PIL, the resize runs
as a horizontal then a vertical pass, each rounded and clamped to uint8 levels. Without
that intermediate rounding, edges that ring past 0 or 255 in the first pass differ by up
to ~10 levels; with it, at most 1 level on ~0.03% of pixels (PIL's fixed-point weights).
Sizes and crop offsets follow torchvision's rounding exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from models.images import Size, normalizer, split_images
from models.swin.config import SwinConfig

__all__ = ["center_crop_offsets", "preprocess_images", "resize_shorter_side_size"]


def resize_shorter_side_size(h: int, w: int, size: int) -> Size:
    """(newh, neww) with the shorter side at `size`, the longer truncated (torchvision's rule)."""
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def center_crop_offsets(h: int, w: int, crop: int) -> tuple[int, int]:
    """(top, left) of a centered `crop x crop` window, rounded as torchvision's CenterCrop.

    torchvision uses Python's round (half to even), so the same is used here.
    """
    return round((h - crop) / 2.0), round((w - crop) / 2.0)


def _resize_crop_like_pil(x: Tensor, newh: int, neww: int, crop: int) -> Tensor:
    """`[1, 3, H, W]` float levels -> resized to (newh, neww), center crop `[3, crop, crop]`.

    PIL's two uint8 passes: horizontal, then vertical. Antialiased bicubic leaves an
    unchanged axis as it is (the kernel is 1 at 0 and 0 at +-1, +-2), so each call below
    resamples one axis. The vertical pass treats columns independently, so the columns
    are cropped before it: exact, and less work for landscape images.
    """
    top, left = center_crop_offsets(newh, neww, crop)
    if neww != x.shape[-1]:
        x = F.interpolate(
            x, (x.shape[-2], neww), mode="bicubic", align_corners=False, antialias=True
        )
        x = x.clamp_(0, 255).round_()
    x = x[..., left : left + crop]  # [1, 3, H, crop]
    if newh != x.shape[-2]:
        x = F.interpolate(x, (newh, crop), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp_(0, 255).round_()
    return x[0, :, top : top + crop]  # [3, crop, crop]


def preprocess_images(
    images: Sequence[Tensor] | Tensor,
    config: SwinConfig,
    device: torch.device | str,
    sizes: Sequence[Size] | None = None,
) -> Tensor:
    """uint8 images -> `[B, 3, S, S]` float32, resized, center-cropped and normalized.

    images: a list of `[H, W, 3]` uint8 tensors, or a jagged nested tensor `[B, j, 3]`
    (j = H*W) with `sizes` giving each (H, W). Runs on `device`; nested inputs are already
    there, list inputs are copied per image.
    """
    S = config.img_size
    views = split_images(images, sizes)
    mean, std = normalizer(str(device), config.mean, config.std)
    batch = torch.empty(len(views), 3, S, S, device=device)
    for k, image in enumerate(views):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(
                f"image {k}: expected uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}"
            )
        h, w = int(image.shape[0]), int(image.shape[1])
        if h < 1 or w < 1:
            raise ValueError(f"image {k}: empty image {h}x{w}")
        newh, neww = resize_shorter_side_size(h, w, config.resize_size)
        x = image.to(device, non_blocking=True).permute(2, 0, 1).float()[None]  # [1, 3, H, W]
        batch[k] = _resize_crop_like_pil(x, newh, neww, S)
    # ToTensor (/255) then Normalize, in torchvision's order of operations
    return batch.div_(255).sub_(mean).div_(std)
