"""Embedding cache: the image encoder's output, kept on the device, keyed by image_id.

The image_id is the SHA-256 of the image bytes, so a client that sends the same file twice,
or names it by id, skips the ~1000 GFLOP encoder. The cache is bounded in bytes and evicts
the least recently used entry; concurrent misses on one image share one computation.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from server.errors import ServiceError


@dataclass(frozen=True)
class ImageEmbedding:
    """What the mask decoder needs from one encoded image."""

    image_id: str
    embedding: torch.Tensor  # [C, h, w] on the model's device
    input_size: tuple[int, int]  # (h, w) after resize-longest-side, before padding
    original_size: tuple[int, int]  # (H, W) of the decoded image

    @property
    def nbytes(self) -> int:
        return self.embedding.numel() * self.embedding.element_size()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class EmbeddingCache:
    """A byte-bounded LRU of embeddings with single-flight computation of misses."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, ImageEmbedding] = collections.OrderedDict()
        self._inflight: dict[str, asyncio.Future[ImageEmbedding]] = {}
        self.bytes_used = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_id: str) -> ImageEmbedding | None:
        """The entry, marked most recently used, or None (counted as hit or miss)."""
        entry = self._entries.get(image_id)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(image_id)
        self.stats.hits += 1
        return entry

    def put(self, entry: ImageEmbedding) -> None:
        """Insert, then evict the oldest entries until the byte bound holds again."""
        if entry.nbytes > self.max_bytes:
            return
        old = self._entries.pop(entry.image_id, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        self._entries[entry.image_id] = entry
        self.bytes_used += entry.nbytes
        while self.bytes_used > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes_used -= evicted.nbytes
            self.stats.evictions += 1

    async def get_or_compute(
        self, image_id: str, compute: Callable[[], Awaitable[ImageEmbedding]]
    ) -> tuple[ImageEmbedding, bool]:
        """Return `(entry, cached)`; a miss runs `compute` once however many callers wait.

        A waiter that is cancelled does not cancel the shared computation for the others.
        """
        entry = self.get(image_id)
        if entry is not None:
            return entry, True
        pending = self._inflight.get(image_id)
        if pending is not None:
            return await asyncio.shield(pending), True
        future: asyncio.Future[ImageEmbedding] = asyncio.get_running_loop().create_future()
        self._inflight[image_id] = future
        try:
            entry = await compute()
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else _cancelled())
            future.exception()  # mark retrieved: waiters (if any) have it too
            raise
        finally:
            self._inflight.pop(image_id, None)
        self.put(entry)
        future.set_result(entry)
        return entry, False


def _cancelled() -> Exception:
    return ServiceError(503, "not_ready", "the request that was encoding this image went away")
