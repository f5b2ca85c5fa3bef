"""COCO run-length encoding: the runs' form on the host, and COCO's counts strings.

The runs are found where the masks are, usually the GPU (`server.engine.runs`); this half
needs no torch, so the frontends, which write the strings, never import it.

pycocotools encodes a mask on the host, holding the GIL, after the whole mask has crossed
from the device: 10-30 ms of one core per full-resolution mask, and 2-10 MB of copies.
Here the device finds the run boundaries of every mask of a batch in column-major order
(COCO's order), plus areas and boxes; only those small arrays cross to the host, in one
copy, where `counts_string` writes COCO's compressed counts with pycocotools' C writer.
The strings are byte-for-byte what `pycocotools.mask.encode` produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pycocotools import mask as mask_utils

__all__ = ["MaskRuns", "counts_string"]


@dataclass
class MaskRuns:
    """K masks of one size as COCO runs, on the host: as run lengths, or as COCO's counts
    strings already written (on the device, `models.sam.coco_kernel`)."""

    size: tuple[int, int]  # (H, W)
    # per mask: run lengths, the first one a run of zeros; uint16 or uint32 (`_counts`);
    # None where `strings` holds them
    counts: list[np.ndarray] | None
    areas: np.ndarray  # int64 [K]
    boxes: np.ndarray  # float64 [K, 4] (x, y, w, h) of the set pixels; zeros when empty
    strings: list[str] | None = None  # per mask: COCO's counts string, where written already

    def __post_init__(self) -> None:
        if (self.counts is None) == (self.strings is None):
            raise ValueError("MaskRuns holds either run lengths or strings")

    def __len__(self) -> int:
        return len(self.areas)

    @property
    def runs(self) -> int:
        """Run lengths a frontend has to write as strings (0 where they are written)."""
        return 0 if self.counts is None else sum(len(c) for c in self.counts)

    def string(self, k: int) -> str:
        """Mask k's COCO counts string."""
        if self.strings is not None:
            return self.strings[k]
        assert self.counts is not None
        return counts_string(self.counts[k])

    def rle(self, k: int) -> dict[str, object]:
        return {"size": [self.size[0], self.size[1]], "counts": self.string(k)}

    def select(self, start: int, stop: int) -> MaskRuns:
        """Masks `start:stop` (one prompt's K masks out of a request's stack)."""
        return MaskRuns(
            self.size,
            None if self.counts is None else self.counts[start:stop],
            self.areas[start:stop],
            self.boxes[start:stop],
            None if self.strings is None else self.strings[start:stop],
        )


def counts_string(counts: np.ndarray) -> str:
    """COCO's compressed counts string for run lengths (the first a run of zeros).

    pycocotools' C writer (`rleToString`, reached through `frPyObjects` with uncompressed
    counts) does it. It runs once per returned mask on the decode threads: for a noise-like
    mask of 164,000 runs it took 1.4 ms where the vectorised numpy writer it replaced took
    4.7 to 5.3 ms (`python -m bench.host_costs`, 2-core CPU); it holds the GIL throughout,
    about as long as numpy held it between its loops for such a mask.
    """
    runs = np.ascontiguousarray(counts, dtype=np.uint32)
    total = int(runs.sum(dtype=np.uint64))
    rle = mask_utils.frPyObjects({"size": [1, total], "counts": runs}, 1, total)
    return rle["counts"].decode("ascii")
