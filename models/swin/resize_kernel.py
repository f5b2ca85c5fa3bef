"""Swin's eval transform for a whole batch of images of any sizes in two kernel launches.

`transforms.preprocess_images` resizes image by image: a dozen torch calls each, made by
the classifier's GPU thread holding the GIL. On the H100 that was most of the thread's
time under load, and the engine's event loop waits for the same GIL (py-spy,
`python -m bench.engine_loop --models defaults`). Here every image of a batch is resized,
centre-cropped and normalized by two Triton launches over the packed pixels:

1. horizontal: each row of each image to the resized width, only the crop's columns;
2. vertical: each cropped column to the resized height, only the crop's rows, then
   ToTensor's /255 and Normalize, into `[B, 3, S, S]` float32.

The arithmetic is Pillow's own (`Image.resize(..., BICUBIC)`, timm's reference): its
antialiased cubic filter (a = -0.5) with coefficients computed in float64 on the host and
turned into 22-bit fixed point as Pillow does, integer sums, and each pass rounded and
clamped to 8-bit levels. So the levels equal Pillow's exactly (tests/models/
test_swin_resize_kernel.py), where the float path is within one level. Coefficients
depend only on (input size, output size, crop), so they are cached: a batch of sizes seen
before costs the host no arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.images import Size
from models.swin.config import SwinConfig
from models.swin.transforms import center_crop_offsets, resize_shorter_side_size
from models.triton_device import triton_installed

__all__ = ["packed_supported", "pil_coefficients", "preprocess_packed"]

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
_A = -0.5  # Pillow's bicubic
_BLOCK_ROWS = 16


def packed_supported(device: torch.device) -> bool:
    """The kernels run on CUDA with Triton (and anywhere under `TRITON_INTERPRET=1`)."""
    return triton_installed() and device.type == "cuda"


def _bicubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    near = ((_A + 2.0) * x - (_A + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=4096)
def pil_coefficients(
    in_size: int, out_size: int, start: int, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pillow's resampling of one axis from `in_size` to `out_size`, for the output
    positions `start .. start + count`: (first input index, taps, fixed-point weights
    `[count, taps_max]`, zero past each position's taps). An axis whose size does not
    change is copied (Pillow skips its pass): one tap of weight 1.0 each."""
    out = np.arange(start, start + count, dtype=np.float64)
    if in_size == out_size:
        first = out.astype(np.int32)
        weights = np.full((count, 1), 1 << PRECISION_BITS, dtype=np.int32)
        return first, np.ones(count, dtype=np.int32), weights
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = math.ceil(support) * 2 + 1
    center = (out + 0.5) * scale
    # C's (int) truncates toward zero; a negative start is clipped to 0 either way
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64)
    taps = last - first
    x = np.arange(ksize, dtype=np.float64)[None, :]
    k = _bicubic((x + first[:, None] - center[:, None] + 0.5) / filterscale)
    k = np.where(x < taps[:, None], k, 0.0)
    total = k.sum(axis=1, keepdims=True)
    k = np.divide(k, total, out=k, where=total != 0.0)
    fixed = np.where(k < 0, -0.5 + k * (1 << PRECISION_BITS), 0.5 + k * (1 << PRECISION_BITS))
    width = max(1, int(taps.max()))
    weights = np.trunc(fixed[:, :width]).astype(np.int32)
    return first.astype(np.int32), taps.astype(np.int32), weights


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Build the kernels on first use, so importing this module never needs Triton."""
    import triton
    import triton.language as tl

    # the filter's width changes with the batch's images: one compiled kernel for any
    @triton.jit(do_not_specialize=["k_max"])
    def horizontal(
        SRC, INTER, PARAMS, FIRST, TAPS, WEIGHTS,
        crop, k_max,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SHIFT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        src_row = tl.load(PARAMS + b * 4)  # first pixel of the image in SRC
        height = tl.load(PARAMS + b * 4 + 1).to(tl.int32)
        width = tl.load(PARAMS + b * 4 + 2).to(tl.int32)
        inter_row = tl.load(PARAMS + b * 4 + 3)  # first pixel of its rows in INTER
        row_ok = rows < height
        col_ok = cols < crop
        first = tl.load(FIRST + b * crop + cols, mask=col_ok, other=0)
        taps = tl.load(TAPS + b * crop + cols, mask=col_ok, other=0)
        half = 1 << (SHIFT - 1)
        acc0 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        acc1 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        acc2 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        base = SRC + (src_row + rows[:, None].to(tl.int64) * width) * 3
        for t in range(0, k_max):
            used = col_ok & (t < taps)
            w = tl.load(WEIGHTS + (b * crop + cols) * k_max + t, mask=used, other=0)
            x = tl.minimum(first + t, width - 1)
            at = base + x[None, :].to(tl.int64) * 3
            ok = row_ok[:, None] & used[None, :]
            acc0 += tl.load(at, mask=ok, other=0).to(tl.int32) * w[None, :]
            acc1 += tl.load(at + 1, mask=ok, other=0).to(tl.int32) * w[None, :]
            acc2 += tl.load(at + 2, mask=ok, other=0).to(tl.int32) * w[None, :]
        out = INTER + (inter_row + rows[:, None].to(tl.int64) * crop + cols[None, :]) * 3
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(out, tl.minimum(tl.maximum(acc0 >> SHIFT, 0), 255).to(tl.uint8), mask=ok)
        tl.store(out + 1, tl.minimum(tl.maximum(acc1 >> SHIFT, 0), 255).to(tl.uint8), mask=ok)
        tl.store(out + 2, tl.minimum(tl.maximum(acc2 >> SHIFT, 0), 255).to(tl.uint8), mask=ok)

    @triton.jit(do_not_specialize=["k_max"])
    def vertical(
        INTER, OUT, PARAMS, FIRST, TAPS, WEIGHTS,
        crop, k_max, mean0, mean1, mean2, std0, std1, std2,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SHIFT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # output rows
        cols = tl.arange(0, BLOCK_C)
        height = tl.load(PARAMS + b * 4 + 1).to(tl.int32)
        inter_row = tl.load(PARAMS + b * 4 + 3)
        row_ok = rows < crop
        col_ok = cols < crop
        first = tl.load(FIRST + b * crop + rows, mask=row_ok, other=0)
        taps = tl.load(TAPS + b * crop + rows, mask=row_ok, other=0)
        half = 1 << (SHIFT - 1)
        acc0 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        acc1 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        acc2 = tl.full([BLOCK_R, BLOCK_C], half, dtype=tl.int32)
        for t in range(0, k_max):
            used = row_ok & (t < taps)
            w = tl.load(WEIGHTS + (b * crop + rows) * k_max + t, mask=used, other=0)
            y = tl.minimum(first + t, height - 1)
            at = INTER + (inter_row + y[:, None].to(tl.int64) * crop + cols[None, :]) * 3
            ok = used[:, None] & col_ok[None, :]
            acc0 += tl.load(at, mask=ok, other=0).to(tl.int32) * w[:, None]
            acc1 += tl.load(at + 1, mask=ok, other=0).to(tl.int32) * w[:, None]
            acc2 += tl.load(at + 2, mask=ok, other=0).to(tl.int32) * w[:, None]
        ok = row_ok[:, None] & col_ok[None, :]
        plane = crop * crop
        out = OUT + b.to(tl.int64) * 3 * plane + rows[:, None] * crop + cols[None, :]
        # ToTensor (/255) then Normalize, in torchvision's order, rounded as torch rounds
        v0 = tl.minimum(tl.maximum(acc0 >> SHIFT, 0), 255).to(tl.float32)
        v1 = tl.minimum(tl.maximum(acc1 >> SHIFT, 0), 255).to(tl.float32)
        v2 = tl.minimum(tl.maximum(acc2 >> SHIFT, 0), 255).to(tl.float32)
        tl.store(out, tl.div_rn(tl.div_rn(v0, 255.0) - mean0, std0), mask=ok)
        tl.store(out + plane, tl.div_rn(tl.div_rn(v1, 255.0) - mean1, std1), mask=ok)
        tl.store(out + 2 * plane, tl.div_rn(tl.div_rn(v2, 255.0) - mean2, std2), mask=ok)

    return horizontal, vertical


def _tables(
    sizes: Sequence[Size], config: SwinConfig
) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """Per image: the packed offsets; per axis: first input index, taps and weights of
    every cropped output position, padded to the batch's widest filter. Returns (params
    `[B, 4]` int64, one int32 array holding the six tables, the widest filter, the pixels
    of the intermediate buffer (each image's rows, S wide), the tallest image)."""
    S, R = config.img_size, config.resize_size
    params = np.empty((len(sizes), 4), dtype=np.int64)
    axes: list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]] = []
    src = inter = 0
    for n, (h, w) in enumerate(sizes):
        newh, neww = resize_shorter_side_size(h, w, R)
        top, left = center_crop_offsets(newh, neww, S)
        axes.append((pil_coefficients(w, neww, left, S), pil_coefficients(h, newh, top, S)))
        params[n] = (src, h, w, inter)
        src += h * w
        inter += h * S
    k_max = max(c[2].shape[1] for pair in axes for c in pair)
    B = len(sizes)
    firsts = np.empty((2, B, S), dtype=np.int32)
    taps = np.empty((2, B, S), dtype=np.int32)
    weights = np.zeros((2, B, S, k_max), dtype=np.int32)
    for n, pair in enumerate(axes):
        for axis, (first, tap, weight) in enumerate(pair):
            firsts[axis, n], taps[axis, n] = first, tap
            weights[axis, n, :, : weight.shape[1]] = weight
    table = np.concatenate([firsts.ravel(), taps.ravel(), weights.ravel()])
    return params, table, k_max, inter, max(h for h, _ in sizes)


def preprocess_packed(values: Tensor, sizes: Sequence[Size], config: SwinConfig) -> Tensor:
    """Packed uint8 pixels `[sum(H*W), 3]` of images of `sizes` (each row-major `[H, W,
    3]`, one after the other) -> `[B, 3, S, S]` float32, resized, centre-cropped and
    normalized as `transforms.preprocess_images` (Pillow's levels exactly)."""
    horizontal, vertical = _kernels()
    S = config.img_size
    device = values.device
    params, table, k_max, inter_pixels, tallest = _tables(sizes, config)
    B = len(sizes)
    tables = torch.from_numpy(table).to(device, non_blocking=True)
    params_t = torch.from_numpy(params).to(device, non_blocking=True)
    n = B * S
    first_h, first_v = tables[0:n], tables[n : 2 * n]
    taps_h, taps_v = tables[2 * n : 3 * n], tables[3 * n : 4 * n]
    weights = tables[4 * n :]
    weights_h, weights_v = weights[: n * k_max], weights[n * k_max :]
    # [sum(H), S, 3]: the horizontal pass's rows (counted in pixels by _tables; sized by
    # S once more, it reserved 6 GB for a batch of 32 photos, docs/BENCHMARKS.md)
    inter = torch.empty(inter_pixels * 3, dtype=torch.uint8, device=device)
    out = torch.empty(B, 3, S, S, dtype=torch.float32, device=device)
    block_c = max(16, 1 << (S - 1).bit_length())
    flat = values.reshape(-1)
    horizontal[(B, -(-tallest // _BLOCK_ROWS))](
        flat, inter, params_t, first_h, taps_h, weights_h, S, k_max,
        BLOCK_R=_BLOCK_ROWS, BLOCK_C=block_c, SHIFT=PRECISION_BITS,
    )  # fmt: skip
    mean, std = config.mean, config.std
    vertical[(B, -(-S // _BLOCK_ROWS))](
        inter, out, params_t, first_v, taps_v, weights_v, S, k_max,
        mean[0], mean[1], mean[2], std[0], std[1], std[2],
        BLOCK_R=_BLOCK_ROWS, BLOCK_C=block_c, SHIFT=PRECISION_BITS,
    )  # fmt: skip
    return out
