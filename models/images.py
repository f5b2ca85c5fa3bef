"""Batches of decoded images on tensors, shared by every model's pre-processing.

Decoded images are `uint8 [H, W, 3]` arrays (numpy in the decode threads, which need no
torch; tensors from `as_pixel_tensor` on the engine's side), held until upload in
`HostPixels` memory (pinned, `PinnedPixels`, when serving on CUDA). A batch of different
sizes travels as one jagged nested tensor of flattened pixels (`[B, j, 3]`, j = H*W)
whose values are one device buffer (`nested_pixels`); `split_images` cuts it back into
per-image views.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "HostPixels",
    "PinnedPixels",
    "Size",
    "as_pixel_tensor",
    "host_pixels",
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
    time under load. From pinned memory (`PinnedPixels`) the copies are DMA transfers that
    overlap the previous batch's kernels.
    """
    flat = [image.reshape(-1, 3) for image in images]
    target = torch.device(device)
    if target.type == "cpu":
        return torch.nested.nested_tensor(flat, layout=torch.jagged)
    return jagged_on(flat, target)


def jagged_on(rows: Sequence[Tensor], device: torch.device) -> Tensor:
    """Jagged nested tensor of `[n_i, 3]` uint8 rows, its values allocated on `device` and
    filled slice by slice with asynchronous copies (no host-side concatenation)."""
    lengths = [int(r.shape[0]) for r in rows]
    values = torch.empty(sum(lengths), 3, dtype=torch.uint8, device=device)
    start = 0
    for r, n in zip(rows, lengths, strict=True):
        values[start : start + n].copy_(r, non_blocking=True)
        start += n
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(
        values,
        upload(offsets, device),
        min_seqlen=min(lengths),
        max_seqlen=max(lengths),
    )


class HostPixels:
    """Where decoded images live until the worker uploads them: ordinary host memory.

    `empty` gives a decoder a numpy buffer to decode straight into and `copy_in` copies an
    array that is already decoded (and perhaps read-only) into one; both are views of a
    tensor this object allocated (the array's `base`), which `as_pixel_tensor` gets back,
    so a pinned block keeps its allocator's bookkeeping through the upload. Calling it
    gives the tensor itself.
    """

    @property
    def held_bytes(self) -> int:
        """Pinned bytes held by images; ordinary memory is not counted here."""
        return 0

    def tensor(self, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.tensor(shape).numpy()

    def copy_in(self, pixels: np.ndarray) -> np.ndarray:
        out = self.empty(tuple(pixels.shape))
        out[...] = pixels
        return out

    def __call__(self, pixels: np.ndarray) -> Tensor:
        out = self.tensor(tuple(pixels.shape))
        out.numpy()[...] = pixels
        return out


def as_pixel_tensor(pixels: np.ndarray | Tensor) -> Tensor:
    """Decoded pixels as the tensor that holds them, without a copy.

    An array that views a whole tensor (what `HostPixels` hands out) gives that tensor
    back: a pinned one then keeps its allocator's context, which an asynchronous upload
    records its event on. Any other array is wrapped as it is (`torch.from_numpy`).
    """
    if isinstance(pixels, Tensor):
        return pixels
    base = pixels.base
    if (
        isinstance(base, Tensor)
        and base.dtype == torch.uint8
        and tuple(base.shape) == pixels.shape
        and base.data_ptr() == pixels.__array_interface__["data"][0]
        and base.is_contiguous()
        and pixels.flags.c_contiguous
    ):
        return base
    return torch.from_numpy(pixels)


host_pixels = HostPixels()


class PinnedPixels(HostPixels):
    """Decoded images in page-locked memory, up to `max_bytes` held at once.

    From pinned memory `nested_pixels`' uploads are asynchronous DMA transfers, and the
    pixels get there in the caller's thread (an image-decode thread), off the GPU worker.
    Pinned memory is locked RAM that CUDA's caching host allocator keeps once it has
    handed it out, so what images hold at once is bounded: past `max_bytes` an image stays
    in ordinary memory (and its upload is a staged copy, as without pinning). A block
    counts until its tensor is freed.
    """

    def __init__(self, max_bytes: int, *, pin_memory: bool | None = None) -> None:
        self.max_bytes = max_bytes
        # No CUDA (CI): plain tensors, with the same accounting, so it can be tested.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def tensor(self, shape: tuple[int, ...]) -> Tensor:
        out, counted = self._allocate(shape)
        if counted:
            weakref.finalize(out, self._release, counted)
        return out

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        out, counted = self._allocate(shape)
        array = out.numpy()
        if counted:  # the tensor object the array holds lives as long as either user
            weakref.finalize(array.base, self._release, counted)
        return array

    def _allocate(self, shape: tuple[int, ...]) -> tuple[Tensor, int]:
        """A tensor, pinned while the budget allows, and the bytes it counts (0: unpinned)."""
        size = math.prod(shape)
        with self._lock:
            fits = size > 0 and self._held + size <= self.max_bytes
            if fits:
                self._held += size
        if not fits:
            return super().tensor(shape), 0
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin_memory), size
        except BaseException:
            self._release(size)
            raise

    def _release(self, size: int) -> None:
        with self._lock:
            self._held -= size


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
