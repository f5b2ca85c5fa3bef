"""Fault injection for tests of the service's failure handling (never set in production).

Out-of-memory, hangs and exceptions cannot be provoked on demand by real requests on a
CPU test machine; these settings make a stage's batch function fail the way a GPU would,
so the tests exercise the real splitting, watchdog and isolation code paths.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """oom_min_batch: batches of at least this many items raise torch.OutOfMemoryError
    (0: never) in `oom_stage` (every stage when empty); hang_stage/hang_s: that stage
    sleeps this long in every batch; raise_stage: that stage raises a real torch
    RuntimeError that is not an allocation failure (a matrix product of mismatched shapes);
    alloc_min_cost: in `oom_stage` (every stage when empty), a batch holding an item of at
    least this cost (`cost` of `wrap`) asks the CPU allocator for an impossible tensor, a
    real allocation failure (a RuntimeError, not torch.OutOfMemoryError) on one item."""

    oom_min_batch: int = 0
    oom_stage: str = ""
    hang_stage: str = ""
    hang_s: float = 0.0
    raise_stage: str = ""
    alloc_min_cost: int = 0

    @property
    def active(self) -> bool:
        hang = self.hang_stage and self.hang_s
        return bool(self.oom_min_batch or hang or self.raise_stage or self.alloc_min_cost)

    def wrap(
        self,
        stage: str,
        fn: Callable[[list[Item]], Sequence[Result | BaseException]],
        cost: Callable[[Item], int] | None = None,
    ) -> Callable[[list[Item]], Sequence[Result | BaseException]]:
        if not self.active:
            return fn
        log.warning("FAULT INJECTION is on for stage %s: %s", stage, self)

        def faulty(items: list[Item]) -> Sequence[Result | BaseException]:
            if self.raise_stage == stage:  # a real torch error, with torch's own words
                torch.ones(2, 3) @ torch.ones(4, 5)
            if self.hang_stage == stage and self.hang_s > 0:
                time.sleep(self.hang_s)
            oom_here = self.oom_stage in ("", stage)
            if oom_here and self.oom_min_batch and len(items) >= self.oom_min_batch:
                raise torch.OutOfMemoryError(f"injected: {len(items)} items in {stage}")
            costs = [1 if cost is None else cost(item) for item in items]
            if oom_here and self.alloc_min_cost and max(costs) >= self.alloc_min_cost:
                torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: the allocator refuses
            return fn(items)

        return faulty
