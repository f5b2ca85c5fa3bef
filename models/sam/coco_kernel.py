"""COCO's compressed counts strings written on the GPU, from the run starts the runs kernel
found (`models.sam.runs_kernel`), so a mask's runs never cross to the host as integers.

Why: with the runs as integers, each returned mask's string was written on a frontend by
pycocotools' C writer, holding its GIL: 1.6 ms for a noise mask of random weights of 165,000
runs (an H200's host), paid by every click, and at 3,000 clicks a second several cores of
the host's sixteen, beside 322 KB a mask as uint16 on the engine's socket where its string
is 206 KB (docs/BENCHMARKS.md, issue 19). Every value of COCO's string is independent but for its
place: value i is written as the difference from value i - 2 (for i > 2) in 5-bit groups,
least significant first, one character each, `0x20` on all but the last and 48 added. So
one launch counts each run's characters, one `cumsum` places them, and one launch writes
them, with each mask's end in the buffer. The leading run of zeros a mask whose first pixel
is set starts with is the character '0', which the host puts in front.

The strings are byte for byte pycocotools' (`rleToString`), checked against it in
tests/models/test_runs_kernel.py through Triton's interpreter and by bench/runs_check.py on
the GPU.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models.sam.runs_kernel import STATS, unspecialised

try:  # importing this module never needs Triton: callers ask `models.triton_device.runs_triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["MAX_CHARS", "MAX_MASKS", "coco_chars", "compiled_variants", "split_strings"]

BLOCK = 1024  # runs per program
MAX_CHARS = 7  # characters of one value: 5 bits each, a sign, 2**31 pixels a mask at most
_SEARCH_STEPS = 12  # the binary search for a run's mask: up to 2**12 masks a batch
MAX_MASKS = 2**_SEARCH_STEPS

# Sizes, counts and offsets change every batch: one compiled kernel each for all of them
# (`models.sam.runs_kernel` says what specialisation cost the service).
_GENERIC = [
    "POS", "STARTS", "STATS", "NCH", "STATS32", "CUM", "ENDS", "CHARS", "n_pos", "n_masks"
]  # fmt: skip
_JIT_OPTIONS = unspecialised(_GENERIC)
# The kernels read and write a mask's statistics as rows of 7 (`runs_kernel.STATS`), a
# literal inside them: a change to the row's width must change them too.
assert STATS == 7, "models.sam.coco_kernel reads rows of 7 statistics a mask"


if triton is not None:

    @triton.jit
    def _value(POS, STARTS, STATS, n_pos, n_masks, j, STEPS: tl.constexpr):
        """Run j's value in its mask's COCO string (its length, less the length two runs
        before where the string says so), its mask, and whether it is a run at all (the
        places past the last run repeat the sentinel: length 0)."""
        live = j < n_pos - 1
        p = tl.load(POS + j, mask=live, other=0)
        length = tl.load(POS + j + 1, mask=live, other=0) - p
        live = live & (length > 0)
        # the mask whose first pixel is the last start at or before p: STARTS[lo] <= p
        # < STARTS[hi], STARTS holding each mask's first pixel and, last, the sentinel's
        lo = tl.zeros_like(j)
        hi = lo + n_masks
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            go = tl.load(STARTS + mid, mask=live, other=0) <= p
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        lead = tl.load(STATS + lo.to(tl.int64) * 7 + 5, mask=live, other=0)  # first pixel set
        first = tl.load(STARTS + lo, mask=live, other=0)
        # value i = run index + lead differs from value i - 2 when i > 2, that is when the
        # run 3 - lead places back is still this mask's
        back = (3 - lead).to(j.dtype)
        earlier = live & (j >= back)
        delta = earlier & (tl.load(POS + j - back, mask=earlier, other=-1) >= first)
        before = tl.load(POS + j - 1, mask=delta, other=0) - tl.load(
            POS + j - 2, mask=delta, other=0
        )
        x = tl.where(delta, length - before, length)
        return x, lo, live

    @triton.jit
    def _n_chars(x):
        """Characters of value x: 5-bit groups until the rest is the sign's extension."""
        n = tl.zeros_like(x).to(tl.int32)
        more = x == x
        for _ in tl.static_range(7):
            c = x & 0x1F
            x = x >> 5
            n += more.to(tl.int32)
            more = more & tl.where((c & 0x10) != 0, x != -1, x != 0)
        return n

    @triton.jit(**_JIT_OPTIONS)
    def _count(
        POS, STARTS, STATS, NCH, STATS32, n_pos, n_masks,
        STEPS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x, _, live = _value(POS, STARTS, STATS, n_pos, n_masks, j, STEPS)
        tl.store(NCH + j, tl.where(live, _n_chars(x), 0), mask=j < n_pos - 1)
        # the statistics as the host reads them (int32, beside the ends): here rather than
        # a copy of their own, one launch fewer a decoder batch
        in_stats = j < n_masks * 7
        tl.store(STATS32 + j, tl.load(STATS + j, mask=in_stats, other=0).to(tl.int32),
                 mask=in_stats)  # fmt: skip

    @triton.jit(**_JIT_OPTIONS)
    def _write(
        POS, STARTS, STATS, CUM, ENDS, CHARS, n_pos, n_masks,
        STEPS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x, mask, live = _value(POS, STARTS, STATS, n_pos, n_masks, j, STEPS)
        n = _n_chars(x)
        end = tl.load(CUM + j, mask=live, other=0)
        at = (end - n).to(tl.int64)
        for t in tl.static_range(7):
            c = (x >> (5 * t)) & 0x1F
            c = tl.where(t < n - 1, c | 0x20, c) + 48
            tl.store(CHARS + at + t, c.to(tl.uint8), mask=live & (t < n))
        # the mask's last run: the next run starts the next mask (or is the sentinel)
        after = tl.load(POS + j + 1, mask=live, other=0)
        last = live & (after >= tl.load(STARTS + mask + 1, mask=live, other=0))
        tl.store(ENDS + mask, end, mask=last)


def coco_chars(
    positions: Tensor,
    starts: Tensor,
    stats: Tensor,
    masks: int,
    ends: Tensor,
    chars: Tensor,
    stats32: Tensor,
) -> None:
    """Write every mask's COCO string but its leading '0' into `chars` (uint8, room for
    `MAX_CHARS` a run), one mask after the other, and where each mask's characters end into
    `ends` (int32 `[masks]`).

    positions: int64, where each run starts and then the sentinel (past the last mask's
    last pixel), which may repeat to the end; starts: int64 `[masks + 1]`, each mask's first
    pixel, then the sentinel's; stats: `[masks, STATS]` int64 from `run_starts` (column 5:
    the first pixel is set), also written as int32 into `stats32` (`[masks * STATS]`), the
    form the host reads.
    """
    if masks > MAX_MASKS:
        raise ValueError(f"{masks} masks in one batch; the strings kernel takes {MAX_MASKS}")
    n_pos = int(positions.shape[0])
    runs = max(n_pos - 1, 0)
    grid = (-(-max(runs, masks * STATS) // BLOCK),)
    n_chars = torch.empty(max(runs, 1), dtype=torch.int32, device=positions.device)
    # launched whatever the runs: it also writes `stats32`, which the host reads every batch
    _count[grid](
        positions, starts, stats, n_chars, stats32, n_pos, masks, STEPS=_SEARCH_STEPS, BLOCK=BLOCK
    )  # fmt: skip
    if runs == 0:
        return
    grid = (-(-runs // BLOCK),)
    cum = torch.cumsum(n_chars, 0, dtype=torch.int32)
    _write[grid](
        positions, starts, stats, cum, ends, chars, n_pos, masks,
        STEPS=_SEARCH_STEPS, BLOCK=BLOCK,
    )  # fmt: skip


def split_strings(chars: np.ndarray, ends: np.ndarray, leads: np.ndarray) -> list[str]:
    """Each mask's string from the characters `coco_chars` wrote (on the host), its ends
    and whether each mask's first pixel is set (its string then starts with '0')."""
    out = []
    start = 0
    for end, lead in zip(ends.tolist(), leads.tolist(), strict=True):
        text = chars[start:end].tobytes().decode("ascii")
        out.append("0" + text if lead else text)
        start = end
    return out


def compiled_variants() -> int | None:
    """Compiled kernels of the two launches on this process's devices (one each is the
    intent: nothing of a batch is a specialisation); None where Triton keeps them
    elsewhere."""
    total = 0
    for kernel in (_count, _write):
        caches = getattr(kernel, "device_caches", None)
        if not caches:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total
