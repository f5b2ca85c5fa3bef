"""The engine's view of the frontends' shared pixel memory (`server.http.pixels`).

Each frontend's file is mapped once by each engine that receives images from it (every
engine, with one per GPU); on CUDA the whole mapping is page-locked (`cudaHostRegister`),
so an image's upload is a DMA straight from the slot the frontend decoded into. An image
reaches the stages as a tensor over its slot. The slot goes back to
its frontend when nothing here reads it any more: when the tensor's storage is freed (a
finalizer on the numpy array the storage keeps alive, so views, batches and shared
encodings all count) and, on CUDA, once the stream has passed every copy queued from it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from server.messages import PixelRef

log = logging.getLogger(__name__)

Release = Callable[[bytes, int], None]  # (frontend identity, slot): back to its frontend


@dataclass
class _Mapping:
    map: mmap.mmap
    buffer: np.ndarray
    registered: bool


class PixelMaps:
    """Maps frontends' pixel files and hands out tensors over their slots."""

    def __init__(self, device: torch.device, release: Release) -> None:
        if device.type == "cuda" and device.index is None:
            # an index: `current_stream(device)` per released slot would otherwise ask the
            # driver which device is current (`torch.cuda.is_available`), about 0.3 ms each
            # on the H100 machine (py-spy of the JPEG decode thread, docs/BENCHMARKS.md)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._release = release
        self._maps: dict[str, _Mapping] = {}
        self._unmappable: set[str] = set()  # `map` failed: not tried again at every status
        self._pending: list[tuple[torch.cuda.Event, bytes, int, str]] = []
        self._lock = threading.Lock()  # finalizers run on whichever thread drops a tensor
        self._live: dict[str, int] = {}  # per file: slots lent here and not yet given back

    def _mapping(self, path: str) -> _Mapping:
        mapping = self._maps.get(path)
        if mapping is None:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            buffer = np.frombuffer(mm, dtype=np.uint8)
            registered = False
            if self.device.type == "cuda":
                address = buffer.__array_interface__["data"][0]
                code = torch.cuda.cudart().cudaHostRegister(address, size, 0)
                registered = int(code) == 0
                if not registered:
                    log.warning("could not page-lock %s (cudaHostRegister: %s); its "
                                "uploads are staged", path, code)  # fmt: skip
            mapping = self._maps[path] = _Mapping(mm, buffer, registered)
            log.info("mapped %s (%.0f MiB%s)", path, size / 2**20,
                     ", page-locked" if registered else "")  # fmt: skip
        return mapping

    def map(self, path: str) -> None:
        """Map (and page-lock) a frontend's file ahead of its first image (`StatusCall`);
        one that cannot be mapped is said once and left to the frontend's first image."""
        if path in self._maps or path in self._unmappable:
            return
        try:
            self._mapping(path)
        except OSError as exc:
            self._unmappable.add(path)
            log.warning("could not map %s ahead of its images: %s", path, exc)

    def tensor(self, ref: PixelRef, owner: bytes) -> torch.Tensor:
        """`uint8` of the ref's shape (`[h, w, 3]` pixels, `[n]` a JPEG file's bytes) over
        the slot; the slot is released when the storage dies."""
        mapping = self._mapping(ref.path)
        array = mapping.buffer[ref.offset : ref.offset + math.prod(ref.shape)]
        with self._lock:
            self._live[ref.path] = self._live.get(ref.path, 0) + 1
        weakref.finalize(array, self._done, owner, ref.slot, ref.path)
        # from_numpy keeps `array` alive exactly as long as the tensor's storage
        return torch.from_numpy(array).view(ref.shape)

    def _done(self, owner: bytes, slot: int, path: str) -> None:
        """The storage is gone (any thread): release now, or once queued copies finish."""
        if self.device.type != "cuda":
            self._given_back(owner, slot, path)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending.append((event, owner, slot, path))

    def _given_back(self, owner: bytes, slot: int, path: str) -> None:
        with self._lock:
            self._live[path] -= 1
        self._release(owner, slot)

    def held_bytes(self) -> int:
        """Page-locked bytes: the frontends' pixel files mapped and registered here."""
        return sum(m.buffer.nbytes for m in self._maps.values() if m.registered)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def poll(self) -> None:
        """Release the slots whose uploads have finished (the engine's loop calls this)."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for event, owner, slot, path in pending:
            if event.query():
                self._given_back(owner, slot, path)
            else:
                with self._lock:
                    self._pending.append((event, owner, slot, path))

    def forget_gone(self) -> None:
        """Unmap the files whose frontend is gone (the supervisor removed them), once no
        tensor or pending copy here reads them."""
        for path in list(self._maps):
            if not os.path.exists(path) and self._live.get(path, 0) == 0:
                log.info("unmapping %s: its frontend is gone", path)
                self.forget(path)

    def forget(self, path: str) -> None:
        """Unmap a frontend's file (the frontend is gone)."""
        mapping = self._maps.pop(path, None)
        self._live.pop(path, None)
        if mapping is None:
            return
        if mapping.registered:
            address = mapping.buffer.__array_interface__["data"][0]
            torch.cuda.cudart().cudaHostUnregister(address)
        del mapping.buffer
        with contextlib.suppress(BufferError):  # tensors still view it: the GC unmaps it
            mapping.map.close()
