"""Low-res mask logits -> where COCO runs begin, and each mask's area, box and first pixel,
in one kernel launch per image size.

A click's masks were made by a chain of small launches: the decoder's low-res logits sorted
and gathered, upscaled to the model's square, cropped, upscaled to the image, thresholded,
transposed to COCO's column-major order, compared pixel to pixel, then areas and boxes by a
dozen reductions (`server.engine.runs.mask_runs`). The GPU work was tens of microseconds;
the host's was dozens of torch calls, each releasing and taking back the GIL the engine's
event loop also wants (docs/BENCHMARKS.md, issue 19). Here one program takes a block of a
mask's pixels in column-major order, computes each one's upscaled logit straight from the
low-res plane (SAM: the bilinear resize to the square, then the crop's bilinear resize to
the image, 16 low-res taps; SAM 2: one resize, 4 taps), thresholds it, and stores whether a
run begins there: where it differs from the pixel before, which is the block's own but for
its first (computed alone; the first version computed every logit twice, and lost to the
full-size path on a batch of 32 noise clicks). The block's set pixels are summed
and bounded, and added to the mask's statistics with one atomic each.

The arithmetic is `F.interpolate(..., mode="bilinear", align_corners=False)`'s, in float32,
so the masks are the eager path's except where a logit lies within float32 rounding of the
threshold, which the two may round to either side (tests/models/test_runs_kernel.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

try:  # importing this module never needs Triton: callers ask `models.triton_device.runs_triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = [
    "STATS", "RunsGroup", "compiled_variants", "initial_stats", "run_starts", "unspecialised",
]  # fmt: skip

BLOCK = 1024  # pixels per program
# per mask: area, x0, y0, x1, y1 (the set pixels' bounds), first pixel set, runs
STATS = 7


@dataclass(frozen=True)
class RunsGroup:
    """Masks of one image size, made from rows of a decoder call's low-res logits."""

    rows: Sequence[int]  # prompt rows of the logits, in output order
    multimask: bool  # each row's three multimask outputs, best score first; else output 0
    input_size: tuple[int, int]  # the resized image inside the model's square (SAM's crop)
    size: tuple[int, int]  # the image's (H, W)


# Every size, offset and pointer changes per batch: one compiled kernel for all of them.
# Triton specialises integers and pointers on divisibility by 16 unless told not to (and
# integers on being 1): the stats' pointer, 8 bytes a row past the rows' start, was aligned
# for an even number of prompts and not for an odd one, and image sides are multiples of 16
# or not, so the service compiled new kernels for about a second each under load (segment
# @50's p99 at 1 s, docs/BENCHMARKS.md).
_GENERIC = [
    "LOW", "ORDER", "ROWS", "BEGINS", "STATS_OUT", "mask0", "pix0", "end", "H", "W",
    "s_p", "s_c", "s_y", "m", "in_h", "in_w", "low_scale", "sy", "sx", "threshold",
]  # fmt: skip


def unspecialised(names: list[str]) -> dict[str, list[str]]:
    """`triton.jit` options that specialise none of `names` (on divisibility by 16, on
    being 1, nor on a pointer's alignment, where this Triton has that option)."""
    options: dict[str, list[str]] = {}
    if triton is not None:
        options["do_not_specialize"] = names
        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
            options["do_not_specialize_on_alignment"] = names
    return options


_JIT_OPTIONS = unspecialised(_GENERIC)


if triton is not None:

    @triton.jit
    def _source(dst, scale, n_in):
        """upsample_bilinear2d's source index (align_corners=False): the two taps along an
        axis and their weights."""
        s = tl.maximum(scale * (dst.to(tl.float32) + 0.5) - 0.5, 0.0)
        i0 = s.to(tl.int32)  # s >= 0: truncation is floor
        i1 = tl.where(i0 < n_in - 1, i0 + 1, i0)
        l1 = s - i0.to(tl.float32)
        return i0, i1, 1.0 - l1, l1

    @triton.jit
    def _bilinear(PLANE, y, x, s_y, m, scale_y, scale_x, live):
        """The low-res `m x m` plane (row stride `s_y`) resized by `scale_y` and `scale_x`
        (source pixels per output pixel), at output pixels (y, x); loads only where `live`."""
        y0, y1, wy0, wy1 = _source(y, scale_y, m)
        x0, x1, wx0, wx1 = _source(x, scale_x, m)
        a = tl.load(PLANE + y0 * s_y + x0, mask=live, other=0.0)
        b = tl.load(PLANE + y0 * s_y + x1, mask=live, other=0.0)
        c = tl.load(PLANE + y1 * s_y + x0, mask=live, other=0.0)
        d = tl.load(PLANE + y1 * s_y + x1, mask=live, other=0.0)
        return wy0 * (wx0 * a + wx1 * b) + wy1 * (wx0 * c + wx1 * d)

    @triton.jit
    def _logit(PLANE, y, x, s_y, m, low_scale, in_h, in_w, sy, sx, live, TWO: tl.constexpr):
        if TWO:  # SAM: m -> the square (low_scale = m / S), cropped to in_h x in_w -> image
            y0, y1, wy0, wy1 = _source(y, sy, in_h)
            x0, x1, wx0, wx1 = _source(x, sx, in_w)
            a = _bilinear(PLANE, y0, x0, s_y, m, low_scale, low_scale, live)
            b = _bilinear(PLANE, y0, x1, s_y, m, low_scale, low_scale, live)
            c = _bilinear(PLANE, y1, x0, s_y, m, low_scale, low_scale, live)
            d = _bilinear(PLANE, y1, x1, s_y, m, low_scale, low_scale, live)
            return wy0 * (wx0 * a + wx1 * b) + wy1 * (wx0 * c + wx1 * d)
        else:  # SAM 2: m -> the image (sy = m / H, sx = m / W)
            return _bilinear(PLANE, y, x, s_y, m, sy, sx, live)

    @triton.jit(**_JIT_OPTIONS)
    def _starts(
        LOW, ORDER, ROWS, BEGINS, STATS_OUT,
        mask0, pix0, end, H, W, s_p, s_c, s_y, m, in_h, in_w, low_scale, sy, sx, threshold,
        K: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        g = tl.program_id(1)  # the group's mask: prompt g // K, rank g % K
        row = tl.load(ROWS + g // K)
        if K > 1:  # rank r is multimask output 1 + ORDER[row, r] (scores sorted, descending)
            channel = 1 + tl.load(ORDER + row * K + g % K)
        else:
            channel = row * 0
        PLANE = LOW + row * s_p + channel * s_c
        n = H * W
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # column-major, as COCO
        ok = j < n
        jj = tl.minimum(j, n - 1)
        x = jj // H
        y = jj - x * H
        on = _logit(PLANE, y, x, s_y, m, low_scale, in_h, in_w, sy, sx, ok, TWO) > threshold
        # The pixel before each (above, or the previous column's last) is the block's own
        # but for its first pixel, whose logit is computed alone (loads for that lane only):
        # the block's values go through its slice of BEGINS, read back shifted by one after
        # a barrier, rather than every logit being computed twice.
        lead = j == tl.program_id(0) * BLOCK
        jp = tl.maximum(jj - 1, 0)
        xp = jp // H
        yp = jp - xp * H
        head = _logit(PLANE, yp, xp, s_y, m, low_scale, in_h, in_w, sy, sx, lead, TWO)
        out = BEGINS + pix0 + g.to(tl.int64) * n + j
        tl.store(out, on.to(tl.uint8), mask=ok)
        tl.debug_barrier()  # the block's stores are seen by all its threads
        stored = tl.load(out - 1, mask=ok & ~lead, other=0)
        before = tl.where(lead, head > threshold, stored != 0)
        begins = (on != before) | (j == 0)
        tl.debug_barrier()  # every thread has read its neighbour before it is overwritten
        tl.store(out, begins.to(tl.uint8), mask=ok)
        mask = (mask0 + g).to(tl.int64)
        hit = on & ok
        area = tl.sum(hit.to(tl.int64), axis=0)
        any_hit = area > 0
        base = STATS_OUT + mask * 7
        tl.atomic_add(base, area, mask=any_hit)
        tl.atomic_min(base + 1, tl.min(tl.where(hit, x, W), axis=0).to(tl.int64), mask=any_hit)
        tl.atomic_min(base + 2, tl.min(tl.where(hit, y, H), axis=0).to(tl.int64), mask=any_hit)
        tl.atomic_max(base + 3, tl.max(tl.where(hit, x, -1), axis=0).to(tl.int64), mask=any_hit)
        tl.atomic_max(base + 4, tl.max(tl.where(hit, y, -1), axis=0).to(tl.int64), mask=any_hit)
        first = tl.sum(((j == 0) & on).to(tl.int64), axis=0)
        tl.store(base + 5, first, mask=tl.program_id(0) == 0)
        tl.atomic_add(base + 6, tl.sum((begins & ok).to(tl.int64), axis=0))  # >= 1: j == 0
        # the sentinel past the last mask, whose position ends the last run
        lead = (tl.program_id(0) == 0) & (g == 0)
        tl.store(BEGINS + end, tl.full([], 1, tl.uint8), mask=lead)


def run_starts(
    low_res: Tensor,
    order: Tensor,
    groups: Sequence[RunsGroup],
    threshold: float,
    square: int | None,
    rows: Tensor,
    begins: Tensor,
    stats: Tensor,
) -> None:
    """Fill `begins` (uint8, one per pixel of every group's masks, one after the other,
    each column-major, then one more set to 1) with 1 where a COCO run begins, and `stats`
    `[masks, STATS]` (int64, initialised by the caller as `initial_stats` does) with each
    mask's statistics.

    low_res: float logits `[P, C, m, m]` (last dimension contiguous); order: `[P, C - 1]`
    int64, each row's multimask outputs by descending score; rows: int64 on the device,
    every group's `rows` one after the other. `square`: SAM's input square (the logits are
    resized to it, cropped to the group's input size, then resized to the image); None for
    SAM 2's single resize.
    """
    if low_res.stride(-1) != 1:
        low_res = low_res.contiguous()
    s_p, s_c, s_y = (int(s) for s in low_res.stride()[:3])
    m = int(low_res.shape[-1])
    mask0 = row0 = pix0 = 0
    end = int(begins.shape[0]) - 1
    for group in groups:
        k = int(order.shape[1]) if group.multimask else 1
        (H, W), (in_h, in_w) = group.size, group.input_size
        masks = len(group.rows) * k
        if square is None:  # float32 divisions, as upsample_bilinear2d makes its scales
            sy, sx = np.float32(m) / np.float32(H), np.float32(m) / np.float32(W)
        else:
            sy, sx = np.float32(in_h) / np.float32(H), np.float32(in_w) / np.float32(W)
        low_scale = np.float32(m) / np.float32(square or m)
        grid = (-(-H * W // BLOCK), masks)
        _starts[grid](
            low_res, order, rows[row0:], begins, stats,
            mask0, pix0, end, H, W, s_p, s_c, s_y, m, in_h, in_w,
            float(low_scale), float(sy), float(sx), float(threshold),
            K=k, TWO=square is not None, BLOCK=BLOCK,
        )  # fmt: skip
        mask0 += masks
        pix0 += masks * H * W
        row0 += len(group.rows)


def initial_stats(masks: int, sizes: Sequence[tuple[int, int]]) -> np.ndarray:
    """`[masks, STATS]` int64 before any pixel: area 0, bounds past the image on each side
    (x0 = W, y0 = H, x1 = y1 = -1), so the atomics' min and max need no special case; no
    runs counted yet."""
    out = np.zeros((masks, STATS), dtype=np.int64)
    out[:, 3:5] = -1
    heights = np.asarray([h for h, _ in sizes], dtype=np.int64)
    widths = np.asarray([w for _, w in sizes], dtype=np.int64)
    out[:, 1] = widths
    out[:, 2] = heights
    return out


def compiled_variants() -> int | None:
    """How many compiled kernels the runs kernel has on this process's devices (one per
    mask count and resize form is the intent); None where Triton keeps them elsewhere."""
    caches = getattr(_starts, "device_caches", None)
    if caches:
        return sum(len(entry[0]) for entry in caches.values())
    return None
