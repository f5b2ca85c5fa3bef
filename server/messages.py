"""The messages between the frontends and the engine, and the frames they become (the
stream that carries the frames is `server.wire`).

A frontend sends `[call id, payload, *buffers]` to its engine over their connection; the
engine answers `[call id, payload, *buffers]` when the call is done, and `[RELEASE,
payload]` when pixels a frontend lent it in shared memory are no longer read. Payloads
are pickles of the dataclasses below (protocol 5: numpy arrays, such as mask runs or
inline pixels, travel as frames of their own, not inside the pickle). Both ends are this
package at one version, started together by the supervisor, so pickle's lack of a schema
costs nothing, and nothing untrusted is ever unpickled: clients' bytes are parsed by the
frontend and only its own messages cross.

Deadlines are `time.monotonic()` instants: Linux's monotonic clock is one clock for every
process on the host.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from server.domain import ModelInfo, SegmentRequest
from server.errors import ServiceError

RELEASE = b"release"  # the first frame of an engine -> frontend release of pixel slots

# A work call the engine's loop reads this long after its frontend sent it is refused at
# once (429), before it is unpickled. Under overload the socket's queues (zmq's 1,000 calls
# a side, per frontend, then; `server.wire`'s buffers now) held several seconds of calls:
# the loop read each one too late to serve it and spent itself refusing them at full cost,
# while the rest aged too: goodput fell to a few % of capacity (docs/BENCHMARKS.md).
# Refused at the door, a stale call costs a few microseconds, so the loop catches up with
# the calls it can still serve.
INTAKE_LAG_S = 1.0


@dataclass(frozen=True)
class PixelRef:
    """Where a decoded image's `uint8 [h, w, 3]` pixels (or a JPEG file's bytes, `[n]`)
    lie in a frontend's shared memory."""

    path: str  # the frontend's shared-memory file (under /dev/shm)
    offset: int
    shape: tuple[int, ...]
    slot: int  # the frontend's id for the region, sent back in a release


@dataclass(frozen=True)
class ImageMsg:
    """An image: its id, its size in the file, and its pixels (maybe decoded smaller: the
    model's resize needs no more), in shared memory or inline when that was full. With
    `jpeg`, the "pixels" are the bytes of a baseline JPEG file the engine decodes itself
    (`Status.jpeg_models`, `server.engine.jpeg`)."""

    image_id: str
    width: int
    height: int
    pixels: PixelRef | np.ndarray
    jpeg: bool = False


@dataclass(frozen=True)
class Traced:
    """A call that may continue a request's trace: the W3C `traceparent` of the frontend's
    span (`server.tracing.stamp`); None while tracing is off."""

    traceparent: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class StatusCall:
    """Readiness, progress and what is loaded; every frontend asks a few times a second.

    `pixels`: the frontend's shared-memory file, which the engine maps (and page-locks, on
    CUDA) at the first status call rather than at the frontend's first image: 128 MiB took
    about 90 ms to page-lock, added to that request (docs/BENCHMARKS.md, issue 24's
    eleventh session)."""

    pixels: str | None = None


@dataclass(frozen=True)
class LookupCall(Traced):
    """Is this image's embedding cached? (`/v1/embed` with only an id)."""

    image_id: str


@dataclass(frozen=True)
class EmbedCall(Traced):
    image: ImageMsg
    deadline: float | None


@dataclass(frozen=True)
class SegmentCall(Traced):
    request: SegmentRequest  # its `image`, when sent, is an ImageMsg


@dataclass(frozen=True)
class EverythingCall(Traced):
    image: ImageMsg | None
    image_id: str | None
    fields: dict[str, float | int]
    output: str
    deadline: float | None


@dataclass(frozen=True)
class ClassifyCall(Traced):
    image: ImageMsg
    top_k: int
    deadline: float | None


@dataclass(frozen=True)
class EmbeddingFileCall(Traced):
    """The cached embedding as a file (`/v1/embeddings/{image_id}`): SAM's `.npy`, SAM 2's
    `.npz`; answered with a `server.domain.EmbeddingFile`."""

    image_id: str


@dataclass(frozen=True)
class CancelCall:
    """The client left (or its deadline passed in the frontend): drop the call's work."""

    call_id: int


@dataclass(frozen=True)
class Status:
    """The engine's state as a frontend serves `/readyz`, `/healthz` and `/v1/models`."""

    ready: bool
    failure: str | None  # why start-up failed
    stuck: str | None  # stages whose batch outlived the watchdog
    progress: dict[str, Any] | None  # the start-up's steps (server.progress)
    models: tuple[ModelInfo, ...]
    # the input sizes the models resize to, for decoding no larger than needed
    sam_image_size: int | None = None
    sam_square: bool = False  # SAM 2: the whole image to a square, not its long side
    swin_resize: int | None = None
    # the models ("sam", "swin") whose images the engine decodes on its device when they
    # are baseline JPEG files: send those files' bytes, not pixels (server.engine.jpeg)
    jpeg_models: tuple[str, ...] = ()
    pid: int = 0


@dataclass(frozen=True)
class Failure:
    """A call that ended in a `ServiceError`: the frontend raises it again as is."""

    status: int
    code: str
    message: str
    headers: dict[str, str] | None = None

    @classmethod
    def of(cls, exc: ServiceError) -> Failure:
        return cls(exc.status, exc.code, exc.message, dict(exc.headers or {}) or None)

    def error(self) -> ServiceError:
        return ServiceError(self.status, self.code, self.message, headers=self.headers)


@dataclass(frozen=True)
class Reply:
    value: Any = None
    failure: Failure | None = None
    timing_ms: dict[str, float] = field(default_factory=dict)


def dump(obj: object) -> list[Any]:
    """`obj` as frames: the pickle, then its out-of-band buffers (no copy of arrays)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [payload, *(b.raw() for b in buffers)]


def load(frames: list[bytes]) -> Any:
    """The object `dump` made, from the frames as they arrived."""
    payload, *buffers = frames
    return pickle.loads(payload, buffers=buffers)


def call_id_bytes(call_id: int, sent: float | None = None) -> bytes:
    """A call's first frame: its id, and for work the engine may refuse when it reads it
    late (`INTAKE_LAG_S`), the `time.monotonic()` it was sent at. Status and cancel calls
    carry none: they are always read."""
    head = call_id.to_bytes(8, "little")
    return head if sent is None else head + struct.pack("<d", sent)


def call_id_of(frame: bytes) -> int:
    return int.from_bytes(frame[:8], "little")


def sent_at(frame: bytes) -> float | None:
    """When the call of this first frame was sent (None: a call that is always read)."""
    return cast(float, struct.unpack_from("<d", frame, 8)[0]) if len(frame) >= 16 else None
