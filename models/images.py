"""Batches of decoded images on tensors, shared by every model's pre-processing.

Decoded images are `uint8 [H, W, 3]` arrays (numpy in the frontends' decode threads, which
need no torch; on the engine's side tensors over the frontends' shared memory, page-locked
on CUDA: `server.engine.pixels`). A batch of different
sizes travels as one jagged nested tensor of flattened pixels (`[B, j, 3]`, j = H*W)
whose values are one device buffer (`nested_pixels`); `split_images` cuts it back into
per-image views.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Size",
    "as_pixel_tensor",
    "jagged_on",
    "nested_pixels",
    "normalizer",
    "split_images",
]

Size = tuple[int, int]


def upload(tensor: Tensor, device: torch.device | str) -> Tensor:
    """`tensor` on `device` without making the host wait for the GPU.

    A copy from ordinary (pageable) host memory is staged by the driver and returns only
    once it has run, that is after everything queued on the stream before it: the worker
    preparing the next batch would wait for the previous one to finish on the GPU. Small
    host tensors (offsets, prompts) are first put in page-locked memory (PyTorch's caching
    host allocator, reused once the copy has run), and the copy is then truly asynchronous.
    """
    target = torch.device(device)
    if target.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(target, non_blocking=True)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(target, non_blocking=True)


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
    supports. On an accelerator the values buffer is allocated there and each image is
    copied straight into its slice, asynchronously: building the nested tensor on the host
    first (`torch.nested.nested_tensor` concatenates there) cost the GPU worker a host-side
    copy of every pixel plus a staged, synchronous upload of the result, about half of its
    time under load. From page-locked memory (the frontends' shared pixel files, registered
    by the engine) the copies are DMA transfers that overlap the previous batch's kernels.
    """
    flat = [image.reshape(-1, 3) for image in images]
    target = torch.device(device)
    if target.type == "cpu":
        return torch.nested.nested_tensor(flat, layout=torch.jagged)
    return jagged_on(flat, target)


def jagged_on(rows: Sequence[Tensor], device: torch.device) -> Tensor:
    """Jagged nested tensor of `[n_i, 3]` uint8 rows, its values allocated on `device` and
    filled slice by slice with asynchronous copies (no host-side concatenation)."""
    values, lengths = packed_on(rows, device)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(
        values,
        upload(offsets, device),
        min_seqlen=min(lengths),
        max_seqlen=max(lengths),
    )


def packed_on(rows: Sequence[Tensor], device: torch.device) -> tuple[Tensor, list[int]]:
    """`[n_i, 3]` uint8 rows one after another in one `[sum n_i, 3]` tensor on `device`,
    each copied asynchronously into its slice; and the n_i."""
    lengths = [int(r.shape[0]) for r in rows]
    values = torch.empty(sum(lengths), 3, dtype=torch.uint8, device=device)
    start = 0
    for r, n in zip(rows, lengths, strict=True):
        values[start : start + n].copy_(used_here(r), non_blocking=True)
        start += n
    return values, lengths


def used_here(tensor: Tensor) -> Tensor:
    """`tensor`, marked as read by this thread's current CUDA stream when it lives on a GPU.

    Pixels decoded on the device (`server.engine.jpeg`) were allocated on the decoding
    thread's stream; without the mark, the caching allocator could give their memory to
    the next decode once they are dropped here, while this stream's copy of them is still
    queued."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return tensor


def as_pixel_tensor(pixels: np.ndarray | Tensor) -> Tensor:
    """Decoded pixels as a tensor, without a copy (the engine's are tensors over a
    frontend's shared memory already; arrays come from tests and benchmarks)."""
    return pixels if isinstance(pixels, Tensor) else torch.from_numpy(pixels)


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
