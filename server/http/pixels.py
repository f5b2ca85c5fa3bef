"""Decoded pixels in shared memory: the frontend decodes into it, the engine reads from it.

Each frontend owns one file in /dev/shm (`SERVE_SHM_BYTES_PER_WORKER`), mapped here and,
read-only in spirit, by every engine it sends images to (page-locked there on CUDA, so the
upload is one DMA with no staging copy; with one engine per GPU each engine maps and
registers the same pages for its own GPU). An image's pixels are a slot of it, written
once by the decoder (libjpeg-turbo decodes straight into the slot) and never copied or
pickled on the way to the GPU.

A slot is freed when both of its holders let go: the request handling it here, and the
engine the call went to, which says so (a release message on that engine's socket) only
once nothing of its own reads the pixels any more (its tensors are gone and the upload has
finished). A client that leaves therefore
never frees memory a batch is still reading. When the file is full the pixels are plain
heap memory and travel inline with the call (one copy more); nothing is refused for it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.messages import PixelRef

log = logging.getLogger(__name__)

ALIGN = 4096  # slots start on pages: the engine's page-locking and DMA like them so

SHM_FOLDER = Path("/dev/shm")
PIXELS_PREFIX = "serve"  # files are `<prefix>-pixels-<pid>-<random>`: the supervisor
# removes a dead frontend's by its pid


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class _Slot:
    offset: int
    size: int
    holders: int


class SharedPixels:
    """A first-fit arena of pixel slots in one shared-memory file (thread-safe: the decode
    threads allocate, the event loop frees)."""

    def __init__(
        self, nbytes: int, folder: Path | None = None, prefix: str = PIXELS_PREFIX
    ) -> None:
        folder = folder or (SHM_FOLDER if SHM_FOLDER.is_dir() else Path("/tmp"))
        self.capacity = _round_up(max(nbytes, ALIGN))
        self.path = folder / f"{prefix}-pixels-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            self._map = mmap.mmap(fd, self.capacity)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}  # by offset
        self.held_bytes = 0
        self.spilled = 0  # images that did not fit and went inline

    def close(self) -> None:
        """Unlink the file (the engine's mapping, if any, stays valid until it unmaps)."""
        self.path.unlink(missing_ok=True)

    # -- the decoder's side (`server.imaging`'s memory protocol) ------------------

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """A writable `uint8` array of `shape`: a slot when one is free, else the heap."""
        size = int(np.prod(shape))
        offset = self._allocate(_round_up(size))
        if offset is None:
            self.spilled += 1
            return np.empty(shape, dtype=np.uint8)
        return self._buffer[offset : offset + size].reshape(shape)

    def copy_in(self, array: np.ndarray) -> np.ndarray:
        out = self.empty(array.shape)
        np.copyto(out, array)
        return out

    def _allocate(self, size: int) -> int | None:
        with self._lock:
            start = 0
            for offset in sorted(self._slots):
                if offset - start >= size:
                    break
                start = offset + self._slots[offset].size
            if start + size > self.capacity:
                return None
            self._slots[start] = _Slot(start, size, holders=1)
            self.held_bytes += size
            return start

    # -- holders ----------------------------------------------------------------------

    def offset_of(self, array: np.ndarray) -> int | None:
        """The slot `array` lies in, or None for heap pixels."""
        base = self._buffer.__array_interface__["data"][0]
        address = array.__array_interface__["data"][0]
        offset = address - base
        if 0 <= offset < self.capacity and offset in self._slots:
            return offset
        return None

    def ref(self, array: np.ndarray) -> PixelRef | np.ndarray:
        """What the engine gets: a reference to the slot (one more holder), or the array."""
        offset = self.offset_of(array)
        if offset is None:
            return array
        with self._lock:
            self._slots[offset].holders += 1
        shape = tuple(int(n) for n in array.shape)
        return PixelRef(str(self.path), offset, shape, slot=offset)

    def release(self, offset: int) -> None:
        """One holder lets go; the last frees the slot."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None:
                log.warning("release of a pixel slot that is not held (offset %d)", offset)
                return
            slot.holders -= 1
            if slot.holders == 0:
                del self._slots[offset]
                self.held_bytes -= slot.size

    def release_array(self, array: np.ndarray) -> None:
        offset = self.offset_of(array)
        if offset is not None:
            self.release(offset)

    @property
    def slots(self) -> int:
        return len(self._slots)
