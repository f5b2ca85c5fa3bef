"""COCO runs of a batch of masks, found on the device (`server.rle` says why).

Everything per mask is done by the GPU: where each run starts, its length, how many runs
each mask has, its first pixel, area and box. One small-integer vector crosses to the host
in one copy into page-locked memory, and the host only splits it: a batch of 24 noise masks
(~100,000 runs each) cost the host ~50 ms of per-mask numpy under the GIL and a 15 ms
pageable copy before (H100, `python -m bench.decoder_batch`, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
from torch import Tensor

from models.images import upload
from models.sam.coco_kernel import MAX_CHARS, coco_chars, split_strings
from models.sam.runs_kernel import STATS, RunsGroup, initial_stats, run_starts
from server.rle import MaskRuns

__all__ = ["RunsCapacity", "RunsGroup", "low_res_runs", "mask_runs"]


def _boxes(masks: Tensor) -> Tensor:
    """XYWH boxes `[K, 4]` of bool masks `[K, H, W]` (all zeros for an empty mask)."""
    _, H, W = masks.shape
    rows, cols = masks.any(dim=2), masks.any(dim=1)  # [K, H], [K, W]
    ys = torch.arange(H, device=masks.device)
    xs = torch.arange(W, device=masks.device)
    y0 = torch.where(rows, ys, H).amin(dim=1)
    y1 = torch.where(rows, ys, -1).amax(dim=1)
    x0 = torch.where(cols, xs, W).amin(dim=1)
    x1 = torch.where(cols, xs, -1).amax(dim=1)
    empty = ~rows.any(dim=1)
    box = torch.stack([x0, y0, x1 - x0 + 1, y1 - y0 + 1], dim=1)
    return torch.where(empty[:, None], torch.zeros_like(box), box)


def _to_host(packed: Tensor) -> np.ndarray:
    """`packed` copied back through page-locked memory (several times a pageable copy's
    rate), waiting for the current stream only, not the whole device."""
    if packed.device.type != "cuda":
        return packed.numpy()
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    torch.cuda.current_stream(packed.device).synchronize()
    return host.numpy()


def mask_runs(stacks: list[Tensor]) -> list[MaskRuns]:
    """bool masks, one `[K, H, W]` stack per image (any sizes, one device) -> COCO runs.

    All stacks are flattened column-major into one vector; a run starts wherever a pixel
    differs from the one before it or a mask begins. One `nonzero` finds them all; lengths
    and each mask's number of runs follow on the device.
    """
    if not stacks:
        return []
    device = stacks[0].device
    counts_per = [int(m.shape[0]) for m in stacks]
    lengths = [int(m.shape[1] * m.shape[2]) for m in stacks]
    flat = torch.cat([m.transpose(1, 2).reshape(-1) for m in stacks])  # column-major, as COCO
    per_mask = np.repeat(np.asarray(lengths, dtype=np.int64), counts_per)
    starts_np = np.concatenate([[0], np.cumsum(per_mask)])[:-1]
    total = int(starts_np.shape[0])
    starts = upload(torch.from_numpy(starts_np), device)  # no sync
    begins = torch.ones_like(flat)
    torch.ne(flat[1:], flat[:-1], out=begins[1:])
    begins[starts] = True
    positions = begins.nonzero().squeeze(1)  # the one sync: how many runs there are
    ends = torch.cat([positions[1:], positions.new_tensor([flat.shape[0]])])
    run_lengths = ends - positions
    mask_of_run = torch.searchsorted(starts, positions, right=True) - 1
    runs_per_mask = torch.bincount(mask_of_run, minlength=total)
    first = flat[starts]
    # areas and boxes once per group of stacks of one size, not once per stack
    by_size: dict[tuple[int, int], list[int]] = {}
    for n, m in enumerate(stacks):
        by_size.setdefault((int(m.shape[1]), int(m.shape[2])), []).append(n)
    order = [n for group in by_size.values() for n in group]
    stats = []
    for group in by_size.values():
        masks = stacks[group[0]] if len(group) == 1 else torch.cat([stacks[n] for n in group])
        stats.append(torch.cat([masks.flatten(1).sum(dim=1)[:, None], _boxes(masks)], dim=1))
    # one copy back; every value fits in int32 (a mask holds at most 2**31 pixels)
    stats_flat = torch.cat(stats).reshape(-1)
    packed = torch.cat([run_lengths, runs_per_mask, first.long(), stats_flat]).to(torch.int32)
    host = _to_host(packed)
    n_runs = int(positions.shape[0])
    all_runs = host[:n_runs]
    per = host[n_runs : n_runs + total]
    first_np = host[n_runs + total : n_runs + 2 * total].astype(bool)
    stats_np = host[n_runs + 2 * total :].reshape(total, 5)
    # the stats came grouped by size: put each stack's rows back in stack order
    row_of_stack: dict[int, int] = {}
    row = 0
    for n in order:
        row_of_stack[n] = row
        row += counts_per[n]
    counts = _counts(all_runs, per, first_np)
    out: list[MaskRuns] = []
    k = 0
    for n, stack in enumerate(stacks):
        rows = stats_np[row_of_stack[n] : row_of_stack[n] + counts_per[n]]
        out.append(
            MaskRuns(
                (int(stack.shape[1]), int(stack.shape[2])),
                counts[k : k + counts_per[n]],
                rows[:, 0].astype(np.int64),
                rows[:, 1:].astype(np.float64),
            )
        )
        k += counts_per[n]
    return out


def _counts(lengths: np.ndarray, per: np.ndarray, first: np.ndarray) -> list[np.ndarray]:
    """Each mask's COCO counts from all masks' run lengths one after the other, each
    mask's number of runs, and whether its first pixel is set (COCO counts start with a
    run of zeros, here an empty one).

    In the narrowest unsigned type that holds the batch's longest run (uint16 or uint32):
    the counts cross to a frontend as they are, and a noise mask's 164,000 runs were
    1.3 MB as int64 where uint16 holds them in 0.33 MB (`counts_string` widens them itself).
    """
    if len(per) == 0:  # stacks of no masks (np.split would still give one piece)
        return []
    longest = int(lengths.max()) if lengths.size else 0
    dtype = np.uint16 if longest <= np.iinfo(np.uint16).max else np.uint32
    split = np.split(lengths.astype(dtype), np.cumsum(per)[:-1])
    zero = np.zeros(1, dtype=dtype)
    return [
        np.concatenate((zero, runs)) if starts_set else runs
        for runs, starts_set in zip(split, first, strict=True)
    ]


class RunsCapacity:
    """How many runs a decoder batch's one copy back makes room for, learnt from the
    batches before it.

    Why: counting the runs first (`nonzero`) makes the host wait for the GPU twice a batch,
    once for the count and once for the copy, and a lone click's decode is mostly such
    host-side gaps around a 0.5 ms graph (docs/BENCHMARKS.md, issue 19). With the room
    fixed before the GPU has counted (`nonzero_static`), the run lengths and the masks'
    statistics cross in one copy after one wait. The statistics say how many runs there
    were: a batch that outgrew its room pays the count and a second copy, as before, and
    raises the room of the batches after it.

    The room follows the masks' pixels: the most runs a pixel of the last `window` batches
    had, with a quarter to spare, rounded up to a whole 1,024; at least `floor` runs a
    mask, what real masks' outlines seldom pass. Room by the mask instead (the most runs a
    mask had) gave a click on an 800x534 photo the room of one on a 1920x1920 photo; with
    random weights' noise masks (about one run in five pixels) that copied up to 8.6 times
    the bytes needed. Spare room costs copy time: with room rounded up to a power of two a
    mask, a batch of eight noise clicks gained nothing over counting first on an H200,
    where one click's batch gained 0.3 ms.
    """

    def __init__(self, floor: int = 1024, window: int = 64) -> None:
        if floor < 1 or window < 1:
            raise ValueError("floor and window must be positive")
        self._floor = floor
        self._recent: deque[float] = deque(maxlen=window)  # runs a pixel
        self._chars: deque[float] = deque(maxlen=window)  # COCO characters a run
        self.overflows = 0  # batches that needed a second copy
        self.chars_overflows = 0  # batches whose strings needed a second copy

    def room(self, masks: int, pixels: int) -> int:
        """Positions to keep for `masks` masks of `pixels` pixels in all: their run starts
        and the sentinel past the last mask (never more than there are pixels)."""
        density = max(self._recent, default=0.0)
        expected = math.ceil(density * 1.25 * pixels / 1024) * 1024  # up to a whole 1,024
        return min(pixels, max(masks * self._floor, expected)) + 1

    def chars(self, runs: int) -> int:
        """Bytes of COCO characters to copy back with the statistics for `runs` runs (the
        rest, if more, crosses in a second copy): the most characters a run of the last
        `window` batches had, a quarter to spare, rounded up to a whole 1,024; two a run
        before any batch (a noise mask's short runs take one or two, an outline's a few)."""
        per_run = max(self._chars, default=2.0)
        return math.ceil(per_run * 1.25 * runs / 1024) * 1024

    def saw(self, pixels: int, runs: int, chars: int | None = None) -> None:
        """A batch whose masks had `pixels` pixels in all had `runs` runs (and `chars`
        characters of COCO strings, where they were written on the device)."""
        if pixels > 0:
            self._recent.append(runs / pixels)
        if chars is not None and runs > 0:
            self._chars.append(chars / runs)


def low_res_runs(
    low_res: Tensor,
    order: Tensor,
    groups: list[RunsGroup],
    threshold: float,
    square: int | None,
    capacity: RunsCapacity | None = None,
    strings: bool = False,
) -> list[MaskRuns]:
    """COCO runs of the masks a decoder call's low-res logits make at each group's image
    size, one `MaskRuns` per group, without the full-size masks ever being made.

    One kernel launch per group finds where runs begin and each mask's statistics
    (`models.sam.runs_kernel`: where runs begin, and each mask's area, box, first pixel and
    number of runs); then the run starts (`nonzero`), one difference and one copy back.
    About ten torch calls for a batch, where upscaling and `mask_runs` took some sixty.
    `order`: `[P, C - 1]`, each row's multimask outputs by descending score; `square`:
    SAM's input square, None for SAM 2 (see `run_starts`). With a `capacity` the host
    waits for the GPU once, at the copy (`RunsCapacity`); without, twice. With `strings`
    the masks come back as COCO's counts strings written on the device
    (`models.sam.coco_kernel`), not as run lengths.
    """
    if not groups:
        return []
    device = low_res.device
    ks = [int(order.shape[1]) if g.multimask else 1 for g in groups]
    per_group = [len(g.rows) * k for g, k in zip(groups, ks, strict=True)]
    total = sum(per_group)
    sizes = [g.size for g, n in zip(groups, per_group, strict=True) for _ in range(n)]
    pixels = np.asarray([h * w for h, w in sizes], dtype=np.int64)
    rows = np.concatenate([np.asarray(g.rows, dtype=np.int64) for g in groups])
    mask_starts = np.concatenate([[0], np.cumsum(pixels)])  # then the sentinel's place
    table = np.concatenate([rows, initial_stats(total, sizes).reshape(-1), mask_starts])
    on_device = upload(torch.from_numpy(table), device)  # one copy in, no sync
    stats = on_device[rows.shape[0] : rows.shape[0] + total * STATS]
    n_pixels = int(pixels.sum())
    begins = torch.empty(n_pixels + 1, dtype=torch.uint8, device=device)
    run_starts(low_res, order, groups, threshold, square, on_device, begins, stats)
    room = None if capacity is None else capacity.room(total, n_pixels)
    if room is None:
        positions = begins.nonzero().squeeze(1)  # waits for the GPU: how many runs
    else:  # room for them fixed now: no wait; unused places repeat the sentinel
        sentinel = int(begins.shape[0]) - 1
        positions = torch.nonzero_static(begins, size=room, fill_value=sentinel).squeeze(1)
    if strings:
        starts = on_device[rows.shape[0] + total * STATS :]
        stats_np, texts = _strings(positions, starts, stats, total, begins, capacity, n_pixels)
        counts: list[np.ndarray] | None = None
    else:
        stats_np, counts = _lengths(positions, stats, total, begins, capacity, room, n_pixels)
        texts = None
    areas = stats_np[:, 0]
    x0, y0, x1, y1 = (stats_np[:, c] for c in range(1, 5))
    boxes = np.stack([x0, y0, x1 - x0 + 1, y1 - y0 + 1], axis=1).astype(np.float64)
    boxes[areas == 0] = 0.0
    out: list[MaskRuns] = []
    start = 0
    for group, n in zip(groups, per_group, strict=True):
        span = slice(start, start + n)
        out.append(
            MaskRuns(
                group.size,
                None if counts is None else counts[span],
                areas[span],
                boxes[span],
                None if texts is None else texts[span],
            )
        )
        start += n
    return out


def _lengths(
    positions: Tensor,
    stats: Tensor,
    total: int,
    begins: Tensor,
    capacity: RunsCapacity | None,
    room: int | None,
    n_pixels: int,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The masks' statistics and run lengths, in one copy (two if the runs outgrew their
    room)."""
    # the statistics first, at a fixed offset: they say how many of the lengths are runs
    host = _to_host(torch.cat([stats.reshape(-1), positions.diff()]).to(torch.int32))
    stats_np = host[: total * STATS].reshape(total, STATS).astype(np.int64)
    n_runs = int(stats_np[:, 6].sum())
    lengths = host[total * STATS : total * STATS + n_runs]
    if capacity is not None:
        capacity.saw(n_pixels, n_runs)
        if room is not None and n_runs + 1 > room:  # outgrew its room: count and copy again
            capacity.overflows += 1
            lengths = _to_host(begins.nonzero().squeeze(1).diff().to(torch.int32))
    if lengths.shape[0] != n_runs:
        raise RuntimeError(f"{lengths.shape[0]} run lengths for {n_runs} runs")
    return stats_np, _counts(lengths, stats_np[:, 6], stats_np[:, 5].astype(bool))


def _strings(
    positions: Tensor,
    starts: Tensor,
    stats: Tensor,
    total: int,
    begins: Tensor,
    capacity: RunsCapacity | None,
    n_pixels: int,
) -> tuple[np.ndarray, list[str]]:
    """The masks' statistics and COCO strings, written on the device, in one copy: the
    statistics and each mask's end in the characters, then as many characters as the
    recent batches needed (`RunsCapacity.chars`); a batch that needed more copies the rest
    after, and one whose runs outgrew their room is done again from all its run starts."""
    head = total * (STATS + 1) * 4  # bytes: the statistics and the ends, int32
    runs = max(int(positions.shape[0]) - 1, 0)
    buf = torch.empty(head + MAX_CHARS * runs, dtype=torch.uint8, device=positions.device)
    values = buf[:head].view(torch.int32)
    ends = values[total * STATS :]
    coco_chars(positions, starts, stats, total, ends, buf[head:], values[: total * STATS])
    guide = capacity if capacity is not None else RunsCapacity()
    room = min(guide.chars(runs), MAX_CHARS * runs)
    host = _to_host(buf[: head + room])
    stats_np = host[: total * STATS * 4].view(np.int32).reshape(total, STATS).astype(np.int64)
    n_runs = int(stats_np[:, 6].sum())
    if n_runs > runs:  # the runs outgrew their room: every run start, and copy it all
        if capacity is not None:
            capacity.overflows += 1
            capacity.saw(n_pixels, n_runs)
        return _strings(begins.nonzero().squeeze(1), starts, stats, total, begins, None, 0)
    ends_np = host[total * STATS * 4 : head].view(np.int32)
    n_chars = int(ends_np[-1]) if total else 0
    chars = host[head:]
    if n_chars > room:  # more characters than the recent batches': the rest, second
        chars = np.concatenate([chars, _to_host(buf[head + room : head + n_chars])])
        if capacity is not None:
            capacity.chars_overflows += 1
    if capacity is not None:
        capacity.saw(n_pixels, n_runs, n_chars)
    return stats_np, split_strings(chars, ends_np, stats_np[:, 5])
