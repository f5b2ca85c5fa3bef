"""Embedding cache: the image encoder's output kept next to the model, keyed by image_id.

The image_id is the SHA-256 of the image bytes, so a client that sends the same file twice,
or names it by id, skips the ~1000 GFLOP encoder. The device tier is bounded in bytes and
evicts the least recently used entry; with a host tier, evicted embeddings move to (pinned)
host memory and come back on their next use instead of being recomputed. Concurrent misses
on one image share one computation, which runs as long as any of them still waits for it:
each waiter keeps its own deadline, and one leaving (504, disconnect) leaves the others be.

`LowResStore` keeps the low-resolution mask logits a client may send back as `mask_input`
to refine a mask (SAM's predictor loop), under random handles, bounded the same way.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import torch

from server.engine.batcher import DEADLINE_CANCEL
from server.errors import ServiceError
from server.observers import CacheObserver

__all__ = ["CacheObserver", "EmbeddingCache", "ImageEmbedding", "LowResStore"]


@dataclass(frozen=True)
class ImageEmbedding:
    """What the mask decoder needs from one encoded image."""

    image_id: str
    embedding: torch.Tensor  # [C, h, w] on the model's device (or host, in the host tier)
    input_size: tuple[int, int]  # (h, w) after the model's resize, before any padding
    original_size: tuple[int, int]  # (H, W) of the decoded image
    # SAM 2's decoder also reads the encoder's projected stride-4 and stride-8 features
    # (s0 [C/8, 4h, 4w], s1 [C/4, 2h, 2w]): cached with the embedding, since a click
    # without them would need the encoder again. SAM has none.
    high_res: tuple[torch.Tensor, ...] = ()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.embedding, *self.high_res)

    @property
    def nbytes(self) -> int:
        """Every tensor the entry holds: SAM 2's high-res features are 3x its embedding
        (6 of 8 MiB in bf16 at 1024 px), so a budget counting the embedding alone would
        hold 4x its bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> ImageEmbedding:
        """The same entry with every tensor through `move` (between the cache's tiers)."""
        return replace(
            self, embedding=move(self.embedding), high_res=tuple(move(t) for t in self.high_res)
        )


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
        self._inflight: dict[str, _Flight] = {}

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
        # A blocking copy (~2 MB, well under a millisecond from pinned memory): this runs on
        # the event loop's thread and stream, and the decoder's thread reads the result on
        # another stream, which would not wait for an asynchronous copy here.
        entry = hosted.moved(lambda t: t.to(self.device))
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
                for gone in self.host_tier.insert(old.moved(self._to_host)):
                    self.observer.cache_event("host_eviction")
                    del gone
        self._report()

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.to("cpu")
        return host.pin_memory() if self._pin else host.clone()

    async def get_or_compute(
        self,
        image_id: str,
        compute: Callable[[], Coroutine[Any, Any, ImageEmbedding]],
        deadline: float | None = None,
    ) -> tuple[ImageEmbedding, bool]:
        """Return `(entry, cached)`; a miss runs `compute` once however many callers wait.

        The computation is a task of its own, not the first caller's: a caller whose
        `deadline` (a `time.monotonic()` instant) passes gets its 504 alone, one that is
        cancelled (client gone) just stops waiting, and the others still get the entry.
        When the last waiter leaves, the computation is cancelled, so nobody's work runs
        for no one (with `DEADLINE_CANCEL` when a deadline was why).
        """
        entry = self.get(image_id)
        if entry is not None:
            return entry, True
        flight = self._inflight.get(image_id)
        joined = flight is not None
        if flight is None:
            task = asyncio.get_running_loop().create_task(self._compute(image_id, compute))
            flight = _Flight(task)
            self._inflight[image_id] = flight
        flight.waiters += 1
        why = "cancelled"
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                entry = await asyncio.wait_for(asyncio.shield(flight.task), timeout)
            except TimeoutError:
                why = DEADLINE_CANCEL
                raise ServiceError(
                    504, "deadline_exceeded", "the request's deadline passed before it was served"
                ) from None
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel(why)
                if self._inflight.get(image_id) is flight:
                    del self._inflight[image_id]
        return entry, joined

    async def _compute(
        self, image_id: str, compute: Callable[[], Coroutine[Any, Any, ImageEmbedding]]
    ) -> ImageEmbedding:
        try:
            entry = await compute()
        finally:
            flight = self._inflight.get(image_id)
            if flight is not None and flight.task is asyncio.current_task():
                del self._inflight[image_id]
        self.put(entry)
        return entry


@dataclass(eq=False)
class _Flight:
    """One image's embedding being computed, and how many callers still wait for it."""

    task: asyncio.Task[ImageEmbedding]
    waiters: int = 0

    def __post_init__(self) -> None:
        # a failure nobody waits for any more is still retrieved (no "never retrieved" log)
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())


@dataclass(frozen=True)
class LowRes:
    image_id: str
    logits: torch.Tensor  # [1, m, m] on the device, m = 4x the embedding side, own storage

    @property
    def nbytes(self) -> int:
        """What the entry keeps alive: its storage, not its view (they are one, see put)."""
        return self.logits.untyped_storage().nbytes()


class LowResStore:
    """Low-res mask logits under unguessable handles, LRU within a byte bound."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, LowRes] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, image_id: str, logits: torch.Tensor) -> str:
        """Keep a copy of `logits`: a view of a request's `[prompts, K, m, m]` logits would
        keep all of them alive while counted as one, and evicting it would free nothing."""
        handle = secrets.token_hex(16)
        entry = LowRes(image_id, logits.clone(memory_format=torch.contiguous_format))
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
