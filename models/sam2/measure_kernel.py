"""SAM 2's segment-everything measurements of each candidate in one Triton launch.

Meta's generator, and `GridMaskGenerator._measure` after it, upscales every candidate's
low-res logits `[m, m]` to the crop's size in float32 (one bilinear resize), then reads
that map three times: two thresholded counts for the stability score, and the box of the
mask. For the ~1,000 candidates of a photo that is gigabytes of float32 written and read
back: 42 to 57 ms of a photo's 328 ms in fp32 on the H100 (`python -m
bench.everything_stages`, docs/BENCHMARKS.md). Here one program per (candidate, band of
rows) computes each output pixel's bilinear value in registers, counts it, tracks the
mask's extent and writes nothing but 6 integers per candidate. A second kernel paints the
kept masks into the final `[K, H, W]` bool tensor the same way.

The arithmetic is PyTorch's CUDA `upsample_bilinear2d` (align_corners=False, no scale
factor): source index `scale * (dst + 0.5) - 0.5` clamped at 0 with `scale = in / out`
in float32, the neighbour index clamped at the last row or column, and
`h0 * (w0 * a + w1 * b) + h1 * (w0 * c + w1 * d)`. The compiler may contract a product
and a sum into one FMA where nvcc made a different choice, so a value can differ from the
unfused path in its last bit; a pixel whose logit lies within that bit of a threshold can
count differently (tests/models/test_sam2_measure_kernel.py compares the two).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models.images import Size

try:  # importing this module never needs Triton: callers ask `models.triton_device.runs_triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["measure_upscaled", "paint_upscaled", "warm_kernels"]

_BLOCK_H = 8
_BLOCK_W = 128
_NO_ROW = 1 << 30  # above any row or column: a band without mask pixels


if triton is not None:
    # module level: a jit function calls another through the module's globals
    @triton.jit
    def _bilinear(
        LOW, k, rows, cols, m, scale_h, scale_w,
    ):  # fmt: skip
        """The upscaled logits of candidate `k` at `rows` x `cols` (float32)."""
        sy = tl.maximum(scale_h * (rows.to(tl.float32) + 0.5) - 0.5, 0.0)
        sx = tl.maximum(scale_w * (cols.to(tl.float32) + 0.5) - 0.5, 0.0)
        y0 = sy.to(tl.int32)  # truncation, as the CUDA kernel's int cast (sy >= 0)
        x0 = sx.to(tl.int32)
        y1 = tl.where(y0 < m - 1, y0 + 1, y0)
        x1 = tl.where(x0 < m - 1, x0 + 1, x0)
        ly = sy - y0.to(tl.float32)
        lx = sx - x0.to(tl.float32)
        hy = 1.0 - ly
        hx = 1.0 - lx
        base = LOW + k.to(tl.int64) * m * m
        top = base + y0[:, None] * m
        bottom = base + y1[:, None] * m
        a = tl.load(top + x0[None, :]).to(tl.float32)
        b = tl.load(top + x1[None, :]).to(tl.float32)
        c = tl.load(bottom + x0[None, :]).to(tl.float32)
        d = tl.load(bottom + x1[None, :]).to(tl.float32)
        upper = hx[None, :] * a + lx[None, :] * b
        lower = hx[None, :] * c + lx[None, :] * d
        return hy[:, None] * upper + ly[:, None] * lower

    # Sizes are not specialised on (divisible by 16, equal to 1): each new class of photo
    # size compiled a variant at its first request, 0.7 to 1.5 s in the service on the H100
    # (docs/BENCHMARKS.md, issue 24's eleventh session); one variant serves every size.
    @triton.jit(do_not_specialize=["m", "height", "width"])
    def _measure(
        LOW, STATS, m, height, width, scale_h, scale_w, inner_t, outer_t, mask_t,
        BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, NO_ROW: tl.constexpr,
    ):  # fmt: skip
        k = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < height
        safe_rows = tl.minimum(rows, height - 1)  # past the last row: computed, not counted
        inner = tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.int32)
        outer = tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.int32)
        left = tl.full([BLOCK_H, BLOCK_W], NO_ROW, dtype=tl.int32)
        right = tl.full([BLOCK_H, BLOCK_W], -1, dtype=tl.int32)
        top = tl.full([BLOCK_H, BLOCK_W], NO_ROW, dtype=tl.int32)
        bottom = tl.full([BLOCK_H, BLOCK_W], -1, dtype=tl.int32)
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            ok = row_ok[:, None] & (cols < width)[None, :]
            value = _bilinear(LOW, k, safe_rows, tl.minimum(cols, width - 1), m, scale_h, scale_w)
            inner += (ok & (value > inner_t)).to(tl.int32)
            outer += (ok & (value > outer_t)).to(tl.int32)
            on = ok & (value > mask_t)
            col_grid = cols[None, :] + tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.int32)
            row_grid = rows[:, None] + tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.int32)
            left = tl.minimum(left, tl.where(on, col_grid, NO_ROW))
            right = tl.maximum(right, tl.where(on, col_grid, -1))
            top = tl.minimum(top, tl.where(on, row_grid, NO_ROW))
            bottom = tl.maximum(bottom, tl.where(on, row_grid, -1))
        out = STATS + k.to(tl.int64) * 6
        tl.atomic_add(out, tl.sum(tl.sum(inner, axis=1), axis=0))
        tl.atomic_add(out + 1, tl.sum(tl.sum(outer, axis=1), axis=0))
        tl.atomic_min(out + 2, tl.min(tl.min(left, axis=1), axis=0))
        tl.atomic_min(out + 3, tl.min(tl.min(top, axis=1), axis=0))
        tl.atomic_max(out + 4, tl.max(tl.max(right, axis=1), axis=0))
        tl.atomic_max(out + 5, tl.max(tl.max(bottom, axis=1), axis=0))

    @triton.jit(do_not_specialize=["m", "height", "width", "image_h", "image_w", "y_off", "x_off"])
    def _paint(
        LOW, ROWS, DEST, MASKS, m, height, width, image_h, image_w, y_off, x_off,
        scale_h, scale_w, mask_t,
        BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        k = tl.load(ROWS + i)
        dest = tl.load(DEST + i).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < height
        safe_rows = tl.minimum(rows, height - 1)
        plane = MASKS + dest * image_h * image_w + (rows[:, None] + y_off).to(tl.int64) * image_w
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            ok = row_ok[:, None] & (cols < width)[None, :]
            value = _bilinear(LOW, k, safe_rows, tl.minimum(cols, width - 1), m, scale_h, scale_w)
            tl.store(plane + (cols[None, :] + x_off), (value > mask_t).to(tl.uint8), mask=ok)


def _scales(m: int, size: Size) -> tuple[float, float]:
    """PyTorch's `in / out` per axis, divided in float32 as its CUDA kernel divides (a
    float32 value, so Triton passes it on unchanged)."""
    return tuple(float(np.float32(m) / np.float32(n)) for n in size)  # type: ignore[return-value]


def measure_upscaled(
    low_res: Tensor, size: Size, mask_threshold: float, offset: float
) -> tuple[Tensor, Tensor]:
    """Low-res logits `[K, m, m]` (any float dtype, on the device) upscaled to `size` in
    float32 -> (stability `[K]` float32, XYXY boxes `[K, 4]` int64 of the mask, inclusive,
    (0, 0, 0, 0) when empty): `stability_score` and `masks_to_boxes` of the upscaled map.

    The thresholds are summed in float64 and rounded to float32, as PyTorch compares a
    float32 tensor with a Python number."""
    K, m = low_res.shape[0], low_res.shape[-1]
    h, w = size
    stats = torch.empty(K, 6, dtype=torch.int32, device=low_res.device)
    stats[:, :2] = 0  # counts
    stats[:, 2:4] = _NO_ROW  # left, top: minima
    stats[:, 4:] = -1  # right, bottom: maxima
    if K > 0:
        scale_h, scale_w = _scales(m, size)
        _measure[(K, -(-h // _BLOCK_H))](
            low_res.contiguous(), stats, m, h, w, scale_h, scale_w,
            mask_threshold + offset, mask_threshold - offset, mask_threshold,
            BLOCK_H=_BLOCK_H, BLOCK_W=_BLOCK_W, NO_ROW=_NO_ROW,
        )  # fmt: skip
    stability = stats[:, 0] / stats[:, 1]  # int32 / int32 -> float32, 0/0 NaN as Meta's
    boxes = stats[:, 2:].to(torch.int64)
    empty = stats[:, 4] < 0
    return stability, torch.where(empty[:, None], torch.zeros_like(boxes), boxes)


def paint_upscaled(
    masks: Tensor,
    low_res: Tensor,
    rows: Tensor,
    dest: Tensor,
    box: tuple[int, int, int, int],
    mask_threshold: float,
) -> None:
    """Write `low_res[rows]` upscaled to the crop `box` (XYXY in `masks`' frame) and
    thresholded into `masks[dest]` at the crop's place; `masks` is bool `[N, H, W]`."""
    if rows.numel() == 0:
        return
    x0, y0, x1, y1 = box
    h, w = y1 - y0, x1 - x0
    m = low_res.shape[-1]
    scale_h, scale_w = _scales(m, (h, w))
    _paint[(rows.numel(), -(-h // _BLOCK_H))](
        low_res.contiguous(), rows, dest, masks.view(torch.uint8), m, h, w,
        masks.shape[1], masks.shape[2], y0, x0, scale_h, scale_w, mask_threshold,
        BLOCK_H=_BLOCK_H, BLOCK_W=_BLOCK_W,
    )  # fmt: skip


def warm_kernels(m: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile both kernels for `dtype` logits of side `m` now (the service's warm-up), on
    an 8 x 8 crop: they are not specialised on sizes, so these serve every photo. Otherwise
    the first segment everything after start-up compiled them: 1.2 s of its 1.3 s in the
    service on the H100 (docs/BENCHMARKS.md, issue 24's eleventh session)."""
    low_res = torch.zeros(1, m, m, dtype=dtype, device=device)
    measure_upscaled(low_res, (8, 8), 0.0, 1.0)
    masks = torch.zeros(1, 8, 8, dtype=torch.bool, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    paint_upscaled(masks, low_res, index, index, (0, 0, 8, 8), 0.0)
