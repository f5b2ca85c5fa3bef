"""Embedding cache: the image encoder's output kept next to the model, keyed by image_id.

The image_id is the SHA-256 of the image bytes, so a client that sends the same file twice,
or names it by id, skips the ~1000 GFLOP encoder. The device tier is bounded in bytes and
evicts the least recently used entry; with a host tier, evicted embeddings move to (pinned)
host memory and come back on their next use instead of being recomputed. Concurrent misses
on one image share one computation.

`LowResStore` keeps the low-resolution mask logits a client may send back as `mask_input`
to refine a mask (SAM's predictor loop), under random handles, bounded the same way.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import torch

from server.errors import ServiceError

__all__ = ["CacheObserver", "EmbeddingCache", "ImageEmbedding", "LowResStore"]


@dataclass(frozen=True)
class ImageEmbedding:
    """What the mask decoder needs from one encoded image."""

    image_id: str
    embedding: torch.Tensor  # [C, h, w] on the model's device (or host, in the host tier)
    input_size: tuple[int, int]  # (h, w) after resize-longest-side, before padding
    original_size: tuple[int, int]  # (H, W) of the decoded image

    @property
    def nbytes(self) -> int:
        return self.embedding.numel() * self.embedding.element_size()


class CacheObserver:
    """Hooks for metrics; the defaults do nothing."""

    def cache_event(self, event: str) -> None:
        """hit, host_hit, miss, eviction (device -> host or gone), host_eviction."""

    def cache_size(self, tier: str, entries: int, nbytes: int) -> None:
        """Called after every change of a tier ("device" or "host")."""


class _Tier:
    """A byte-bounded LRU of embeddings."""

    def __init__(self, name: str, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[str, ImageEmbedding] = collections.OrderedDict()
        self.nbytes = 0

    def pop(self, image_id: str) -> ImageEmbedding | None:
        entry = self.entries.pop(image_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def insert(self, entry: ImageEmbedding) -> list[ImageEmbedding]:
        """Insert as most recent; return what had to leave to stay within the bound."""
        self.pop(entry.image_id)
        self.entries[entry.image_id] = entry
        self.nbytes += entry.nbytes
        evicted = []
        while self.nbytes > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            evicted.append(old)
        return evicted


class EmbeddingCache:
    """Device tier + optional host tier, single-flight computation of misses."""

    def __init__(
        self,
        max_bytes: int,
        host_bytes: int = 0,
        device: torch.device | None = None,
        observer: CacheObserver | None = None,
    ) -> None:
        self.device_tier = _Tier("device", max_bytes)
        # Host copies are pinned where a GPU can read them back asynchronously. (On a CPU
        # device both tiers are host memory; the second is then just a colder LRU.)
        self.host_tier = _Tier("host", host_bytes)
        self.device = device or torch.device("cpu")
        self._pin = self.device.type == "cuda"
        self.observer = observer or CacheObserver()
        self._inflight: dict[str, asyncio.Future[ImageEmbedding]] = {}

    def __len__(self) -> int:
        return len(self.device_tier.entries) + len(self.host_tier.entries)

    @property
    def bytes_used(self) -> int:
        return self.device_tier.nbytes

    def _report(self) -> None:
        for tier in (self.device_tier, self.host_tier):
            self.observer.cache_size(tier.name, len(tier.entries), tier.nbytes)

    def peek(self, image_id: str) -> ImageEmbedding | None:
        """The entry if cached in either tier, without counting or reordering."""
        return self.device_tier.entries.get(image_id) or self.host_tier.entries.get(image_id)

    def get(self, image_id: str) -> ImageEmbedding | None:
        """The entry on the device, marked most recently used, or None (a miss)."""
        entry = self.device_tier.entries.get(image_id)
        if entry is not None:
            self.device_tier.entries.move_to_end(image_id)
            self.observer.cache_event("hit")
            return entry
        hosted = self.host_tier.pop(image_id)
        if hosted is None:
            self.observer.cache_event("miss")
            return None
        self.observer.cache_event("host_hit")
        entry = replace(hosted, embedding=hosted.embedding.to(self.device, non_blocking=True))
        self.put(entry)
        return entry

    def put(self, entry: ImageEmbedding) -> None:
        """Insert on the device; what leaves it goes to the host tier, if there is one."""
        if entry.nbytes > self.device_tier.max_bytes:
            return
        self.host_tier.pop(entry.image_id)
        for old in self.device_tier.insert(entry):
            self.observer.cache_event("eviction")
            if self.host_tier.max_bytes >= old.nbytes:
                host = old.embedding.to("cpu")
                host = host.pin_memory() if self._pin else host.clone()
                for gone in self.host_tier.insert(replace(old, embedding=host)):
                    self.observer.cache_event("host_eviction")
                    del gone
        self._report()

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


@dataclass(frozen=True)
class LowRes:
    image_id: str
    logits: torch.Tensor  # [1, m, m] on the device, m = 4x the embedding side

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


class LowResStore:
    """Low-res mask logits under unguessable handles, LRU within a byte bound."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, LowRes] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, image_id: str, logits: torch.Tensor) -> str:
        handle = secrets.token_hex(16)
        entry = LowRes(image_id, logits)
        self._entries[handle] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return handle

    def get(self, handle: str, image_id: str) -> torch.Tensor:
        """The logits for a refinement of `image_id`; 404 if gone, 422 if for another image."""
        entry = self._entries.get(handle)
        if entry is None:
            raise ServiceError(
                404,
                "unknown_mask_input",
                f"mask_input {handle} is not known (expired or never issued); send the "
                "request without it, or with a handle from a recent response",
            )
        if entry.image_id != image_id:
            raise ServiceError(
                422, "invalid_request", "mask_input comes from a response on another image"
            )
        self._entries.move_to_end(handle)
        return entry.logits
