"""The hooks the engine's batchers and embedding cache call, so that metrics stay out of
their logic.

Kept apart from server/engine/ (which imports torch) because `server.metrics.Metrics`
implements them and the HTTP frontends, which never import torch, build a `Metrics` too.
"""

from __future__ import annotations

from collections.abc import Sequence


class BatchObserver:
    """Hooks the batcher calls so metrics stay out of the batching logic."""

    def declare(self, stage: str) -> None:
        """Called once per stage when its batcher is made, before any item arrives."""

    def queue_depth(self, stage: str, depth: int) -> None:
        """Called whenever the number of waiting items changes."""

    def batch_started(self, stage: str, size: int, cost: int, waits_s: Sequence[float]) -> None:
        """Called as a batch leaves the queue, with each item's time in the queue."""

    def batch_finished(self, stage: str, size: int, seconds: float, failed: bool) -> None:
        """Called when a batch's computation ends."""

    def rejected(self, stage: str, reason: str) -> None:
        """Called when an item is refused or dropped (queue_full, deadline, cancelled)."""

    def out_of_memory(self, stage: str, size: int) -> None:
        """Called when a batch of `size` items ran out of device memory (then split)."""

    def batch_gpu(self, stage: str, seconds: float) -> None:
        """Called from the stage's worker thread with a CUDA batch's span on its stream,
        from the batch's first queued work to its last finished (`server.engine.workers`)."""


class CacheObserver:
    """Hooks for metrics; the defaults do nothing."""

    def cache_event(self, event: str) -> None:
        """hit, host_hit, miss, eviction (device -> host or gone), host_eviction."""

    def cache_size(self, tier: str, entries: int, nbytes: int) -> None:
        """Called after every change of a tier ("device" or "host")."""
