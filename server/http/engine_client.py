"""The frontend's side of the engine: calls over zmq, with the same coroutines routes await.

One DEALER socket per frontend process; each call gets an id and a future that the reader
task resolves when the engine answers. A call whose awaiting request is cancelled (the
client left) sends the engine a cancel, so queued work is dropped there too. Pixels go as
references to this process's shared memory (`server.http.pixels`); the engine gives each
slot back with a release message when it is done reading it.

The engine's status (ready, start-up progress, what is loaded, a stuck batch) is asked for
a few times a second and kept here, so probes and `require_engine` never wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio

from server import tracing
from server.domain import (
    ClassifyResult,
    EmbedResult,
    Image,
    ModelInfo,
    SegmentRequest,
    SegmentResult,
)
from server.errors import ServiceError
from server.http.pixels import SharedPixels
from server.messages import (
    RELEASE,
    CancelCall,
    ClassifyCall,
    EmbedCall,
    EmbeddingNpyCall,
    EverythingCall,
    ImageMsg,
    LookupCall,
    Reply,
    SegmentCall,
    Status,
    StatusCall,
    call_id_bytes,
    call_id_of,
    dump,
    load,
)

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.25  # how often a frontend asks the engine's status (0.05 s until ready)
# No status answer for this long: /healthz says the engine is not answering (Kubernetes
# restarts the pod). Requests keep going to it meanwhile: under a burst the answer to a
# status call waits behind thousands of calls, and refusing them all for that (503) turned
# an overload into an outage (docs/BENCHMARKS.md, the first mixed run).
STATUS_STALE_S = 60.0
DEADLINE_GRACE_S = 1.0  # past a call's deadline, the frontend stops waiting for the engine


class EngineClient:
    """Calls into the engine process; one per frontend process (or embedded app)."""

    def __init__(self, address: str, pixels: SharedPixels | None) -> None:
        self.address = address
        self.pixels = pixels
        self.status: Status | None = None
        self.status_at = 0.0  # monotonic time of the last status answer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        sock = self._socket = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._tasks = [
            asyncio.create_task(self._read(sock), name="engine-replies"),
            asyncio.create_task(self._poll_status(), name="engine-status"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ServiceError(503, "not_ready", "the service is stopping"))
        self._waiting.clear()
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()

    # -- state --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Ready by the engine's last word (a late answer is no reason to refuse work)."""
        return self.status is not None and self.status.ready

    @property
    def stale(self) -> bool:
        """The engine has not answered a status call for a while (it hangs or is gone)."""
        return self.status is not None and time.monotonic() - self.status_at > STATUS_STALE_S

    def models(self) -> list[ModelInfo]:
        return list(self.status.models) if self.status is not None else []

    def model_brief(self, prefix: str) -> dict[str, str]:
        """The `model` field of a response: the loaded model whose name starts so."""
        for info in self.models():
            if info.name.startswith(prefix):
                return info.brief()
        raise ServiceError(503, "not_ready", f"no {prefix} model is loaded")

    async def _poll_status(self) -> None:
        while True:
            try:
                reply = await self._call(StatusCall(), deadline=time.monotonic() + 2.0)
                self.status = reply.value
                self.status_at = time.monotonic()
            except ServiceError:
                pass  # not answering: `stale` says so once it lasts
            ready = self.status is not None and self.status.ready
            await asyncio.sleep(STATUS_PERIOD_S if ready else 0.05)

    # -- the socket ---------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            head, *payload = frames
            if head.bytes == RELEASE:
                if self.pixels is not None:
                    for slot in load(payload):
                        self.pixels.release(slot)
                continue
            future = self._waiting.pop(call_id_of(head), None)
            if future is not None and not future.done():
                future.set_result(load(payload))

    async def _call(self, call: object, deadline: float | None) -> Reply:
        assert self._socket is not None, "start() the client first"
        call_id = next(self._ids)
        call = tracing.stamp(call)  # the current span's traceparent, when tracing is on
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._socket.send_multipart([call_id_bytes(call_id), *dump(call)], copy=False)
        timeout = None if deadline is None else deadline - time.monotonic() + DEADLINE_GRACE_S
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self._cancel(call_id)
            raise ServiceError(504, "deadline", "the engine did not answer in time") from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise

    def _cancel(self, call_id: int) -> None:
        self._waiting.pop(call_id, None)
        if self._socket is not None:
            frames = [call_id_bytes(0), *dump(CancelCall(call_id))]
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart(frames, copy=False)  # queued; no await needed

    async def _value(self, call: object, deadline: float | None) -> Any:
        reply = await self._call(call, deadline)
        if reply.failure is not None:
            raise reply.failure.error()
        return reply.value

    def _image(self, image: Image) -> ImageMsg:
        pixels: Any = image.pixels
        ref = self.pixels.ref(pixels) if self.pixels is not None else pixels
        return ImageMsg(image.image_id, image.width, image.height, ref)

    # -- the engine's API, as routes use it ---------------------------------------------

    async def segment(self, request: SegmentRequest) -> SegmentResult:
        if request.image is not None:
            request = replace(request, image=self._image(request.image))  # type: ignore[arg-type]
        result: SegmentResult = await self._value(SegmentCall(request), request.deadline)
        return result

    async def embed(self, image: Image, deadline: float | None = None) -> EmbedResult:
        result: EmbedResult = await self._value(EmbedCall(self._image(image), deadline), deadline)
        return result

    async def lookup(self, image_id: str) -> EmbedResult:
        result: EmbedResult = await self._value(LookupCall(image_id), time.monotonic() + 10.0)
        return result

    async def classify(
        self, image: Image, top_k: int, deadline: float | None = None
    ) -> ClassifyResult:
        call = ClassifyCall(self._image(image), top_k, deadline)
        result: ClassifyResult = await self._value(call, deadline)
        return result

    async def everything(
        self,
        image: Image | None,
        image_id: str | None,
        fields: dict[str, float | int],
        output: str = "rle",
        deadline: float | None = None,
    ) -> Any:
        """(image_id, width, height, EverythingMasks, timing)."""
        message = self._image(image) if image is not None else None
        return await self._value(
            EverythingCall(message, image_id, fields, output, deadline), deadline
        )

    async def embedding_npy(self, image_id: str) -> tuple[tuple[int, int], tuple[int, int], bytes]:
        """(original size, input size, the `.npy` bytes)."""
        value: tuple[tuple[int, int], tuple[int, int], bytes] = await self._value(
            EmbeddingNpyCall(image_id), time.monotonic() + 30.0
        )
        return value
