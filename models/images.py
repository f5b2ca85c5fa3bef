"""Batches of decoded images on tensors, shared by every model's pre-processing.

Decoded images are `uint8 [H, W, 3]` tensors. A batch of different sizes may travel as one
jagged nested tensor of flattened pixels (`[B, j, 3]`, j = H*W), so the host-to-device copy
is a single buffer; `split_images` cuts it back into per-image views.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Size", "nested_pixels", "normalizer", "split_images"]

Size = tuple[int, int]


@functools.lru_cache(maxsize=16)
def normalizer(
    device: str, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[Tensor, Tensor]:
    """Mean and std as `[3, 1, 1]` tensors on `device`, made once per process.

    Building them per batch would copy host memory to the device each time, a sync.
    """
    return torch.tensor(mean).view(3, 1, 1).to(device), torch.tensor(std).view(3, 1, 1).to(device)


def nested_pixels(images: Sequence[Tensor], device: torch.device | str) -> Tensor:
    """Pack uint8 `[H, W, 3]` images of any sizes into one jagged `[B, j, 3]` tensor on `device`.

    Flattening each image to `[H*W, 3]` leaves one ragged dimension, which the jagged layout
    supports; the whole batch crosses to the device as one buffer.
    """
    flat = [image.reshape(-1, 3) for image in images]
    nested = torch.nested.nested_tensor(flat, layout=torch.jagged)
    if torch.device(device).type != "cpu":
        return nested.to(device, non_blocking=True)
    return nested


def split_images(images: Sequence[Tensor] | Tensor, sizes: Sequence[Size] | None) -> list[Tensor]:
    """Per-image `[H, W, 3]` uint8 views of a list or of a jagged `[B, j, 3]` nested tensor.

    The nested tensor is cut with host-side sizes (offsets from `sizes`), never by reading
    its device offsets, so no host-device synchronisation happens.
    """
    if isinstance(images, Tensor) and images.is_nested:
        if sizes is None or len(sizes) != images.size(0):
            raise ValueError("a nested image batch needs one (H, W) size per image")
        flat = images.values()  # [sum(H*W), 3]
        total = sum(h * w for h, w in sizes)
        if total != flat.shape[0]:
            raise ValueError(f"sizes cover {total} pixels, the nested batch holds {flat.shape[0]}")
        offsets = images.offsets()  # type: ignore[attr-defined]
        if offsets.device.type == "cpu":  # checking device offsets would cost a sync
            expected = torch.tensor([0] + [h * w for h, w in sizes]).cumsum(0)
            if not torch.equal(offsets.to(torch.int64), expected):
                raise ValueError("sizes do not match the nested batch's image lengths")
        views, start = [], 0
        for h, w in sizes:
            views.append(flat[start : start + h * w].view(h, w, 3))
            start += h * w
        return views
    views = list(images)
    if sizes is not None and [tuple(v.shape[:2]) for v in views] != [tuple(s) for s in sizes]:
        raise ValueError("sizes do not match the images' shapes")
    return views
