"""The frontend's side of the engines: calls over Unix sockets (`server.wire`), with the
same coroutines routes await.

One connection per engine process; each call gets an id and a future that the
connection's reader resolves when its engine answers. Each engine keeps
its own embedding cache, so a call about an image (embed, segment, everything, lookup, the
embedding download) goes to the image's home engine, `rendezvous_hash(image_id)`: every
frontend computes the same home without talking to the others, and it stays the same
across restarts. A call about no cached image (classify) goes to the engine with the
fewest calls in flight from this frontend. A call whose awaiting request is cancelled (the
client left) sends the engine a cancel, so queued work is dropped there too. Pixels go as
references to this process's shared memory (`server.http.pixels`), which every engine maps;
the engine a call went to gives its slot back with a release message when it is done
reading it.

Every engine's status (ready, start-up progress, what is loaded, a stuck batch) is asked
for a few times a second and kept here, combined into the service's (`combined_status`:
ready once every engine is), so probes never wait on it. A request that finds the service
not ready asks once more (`refresh`, one status round for all such requests together)
before refusing: another frontend may already have said ready, and a client sent there
by the kernel must not get this one's 503 from up to a poll period ago.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from server import tracing, wire
from server.domain import (
    ClassifyResult,
    EmbeddingFile,
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
    EmbeddingFileCall,
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
REFRESH_WITHIN_S = 1.0  # how long a request found not ready waits for a fresh status
# No status answer for this long: /healthz says the engine is not answering (Kubernetes
# restarts the pod). Requests keep going to it meanwhile: under a burst the answer to a
# status call waits behind thousands of calls, and refusing them all for that (503) turned
# an overload into an outage (docs/BENCHMARKS.md, the first mixed run).
STATUS_STALE_S = 60.0
DEADLINE_GRACE_S = 1.0  # past a call's deadline, the frontend stops waiting for the engine


def rendezvous_hash(image_id: str, engines: Sequence[int]) -> int:
    """The engine of `engines` that is `image_id`'s home: the one whose weight for it is
    highest (highest-random-weight hashing).

    Each engine's weight depends only on the engine and the id, so every frontend picks
    the same engine, each engine is home to 1/N of the images, and when one engine leaves
    the set only its own images move (each to its second-highest weight). The weight is
    a keyed BLAKE2b, not Python's `hash` (salted per process)."""
    best, best_weight = -1, -1
    for engine in engines:
        digest = hashlib.blake2b(
            image_id.encode(), digest_size=8, salt=engine.to_bytes(8, "little")
        )
        weight = int.from_bytes(digest.digest(), "little")
        if weight > best_weight:
            best, best_weight = engine, weight
    if best < 0:
        raise ValueError("no engine to choose from")
    return best


@dataclass(eq=False)
class EngineLink:
    """One engine process as this frontend sees it."""

    index: int
    address: str
    connection: wire.Framed | None = None  # None until connected (and after it is lost)
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set when a connection ends
    # each call's future: its reply and when that was read (perf_counter)
    waiting: dict[int, asyncio.Future[tuple[Reply, float]]] = field(default_factory=dict)
    status: Status | None = None
    status_at: float = 0.0  # monotonic time of its last status answer
    in_flight: int = 0  # this frontend's calls it has not answered yet (status calls aside)


def combined_status(statuses: Sequence[Status | None]) -> Status | None:
    """The service's status from each engine's (None: not answered yet): ready once every
    engine is; the first failure; every stuck stage; the progress of the engine furthest
    behind. Models and input sizes are the same in every engine (one settings object)."""
    known = [s for s in statuses if s is not None]
    if not known:
        return None

    def named(index: int, text: str) -> str:
        return f"engine-{index}: {text}" if len(statuses) > 1 else text

    failures = [named(i, s.failure) for i, s in enumerate(statuses) if s and s.failure]
    stuck = [named(i, s.stuck) for i, s in enumerate(statuses) if s and s.stuck]
    warming = [s for s in known if not s.ready]

    def done(status: Status) -> float:
        p = status.progress
        return p["step"] / max(1, p["of"]) if p else 0.0

    behind = min(warming or known, key=done)
    first = known[0]
    return Status(
        ready=len(known) == len(statuses) and not warming,
        failure=failures[0] if failures else None,
        stuck="; ".join(stuck) or None,
        progress=behind.progress,
        models=first.models,
        sam_image_size=first.sam_image_size,
        sam_square=first.sam_square,
        swin_resize=first.swin_resize,
        # any engine may get any image: what every engine decodes
        jpeg_models=tuple(m for m in first.jpeg_models if all(m in s.jpeg_models for s in known)),
        pid=first.pid,
    )


def _expire(future: asyncio.Future[tuple[Reply, float]]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class EngineClient:
    """Calls into the engine processes; one per frontend process (or embedded app)."""

    def __init__(self, address: str | Sequence[str], pixels: SharedPixels | None) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("an engine client needs at least one engine address")
        self.engines = [EngineLink(index, a) for index, a in enumerate(addresses)]
        self.pixels = pixels
        self.status: Status | None = None  # every engine's, combined
        self._ids = itertools.count(1)
        self._turns = itertools.count()  # round robin among equally loaded engines
        self._tasks: list[asyncio.Task[None]] = []
        self._refreshing: asyncio.Future[list[None]] | None = None
        self._closing = False

    async def start(self) -> None:
        """Connect to every engine (in the background: an engine may not listen yet; calls
        made meanwhile wait to be sent) and start asking their status."""
        for link in self.engines:
            self._tasks.append(
                asyncio.create_task(self._connect(link), name=f"engine-{link.index}-connect")
            )
            self._tasks.append(
                asyncio.create_task(self._poll_status(link), name=f"engine-{link.index}-status")
            )

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self.engines:
            self._fail_waiting(link, ServiceError(503, "not_ready", "the service is stopping"))
            if link.connection is not None:
                link.connection.close()
                link.connection = None

    @staticmethod
    def _fail_waiting(link: EngineLink, error: ServiceError) -> None:
        for future in link.waiting.values():
            if not future.done():
                future.set_exception(error)
        link.waiting.clear()

    # -- state --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Ready by every engine's last word (a late answer is no reason to refuse work)."""
        return self.status is not None and self.status.ready

    @property
    def stale(self) -> bool:
        """An engine has not answered a status call for a while (it hangs or is gone)."""
        now = time.monotonic()
        return any(
            link.status is not None and now - link.status_at > STATUS_STALE_S
            for link in self.engines
        )

    def models(self) -> list[ModelInfo]:
        return list(self.status.models) if self.status is not None else []

    def model_brief(self, prefix: str) -> dict[str, str]:
        """The `model` field of a response: the loaded model whose name starts so."""
        for info in self.models():
            if info.name.startswith(prefix):
                return info.brief()
        raise ServiceError(503, "not_ready", f"no {prefix} model is loaded")

    async def _ask_status(self, link: EngineLink, within_s: float) -> None:
        """One status round trip to `link`'s engine; no answer leaves its last status."""
        try:
            pixels = None if self.pixels is None else str(self.pixels.path)
            reply = await self._call(StatusCall(pixels), time.monotonic() + within_s, link)
            link.status = reply.value
            link.status_at = time.monotonic()
            self.status = combined_status([e.status for e in self.engines])
        except ServiceError:
            pass  # not answering: `stale` says so once it lasts

    async def _poll_status(self, link: EngineLink) -> None:
        while True:
            await self._ask_status(link, 2.0)
            ready = link.status is not None and link.status.ready
            await asyncio.sleep(STATUS_PERIOD_S if ready else 0.05)

    async def refresh(self) -> bool:
        """Every engine's status asked now, then `ready`. Callers that come while a round
        is out wait for that one: a burst against a warming service costs the engines one
        status call each, not one per request."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(
                asyncio.gather(*(self._ask_status(link, REFRESH_WITHIN_S) for link in self.engines))
            )
        await asyncio.shield(self._refreshing)  # one caller's cancellation ends only its wait
        return self.ready

    # -- routing ------------------------------------------------------------------------

    def engine_for(self, image_id: str | None) -> EngineLink:
        """The image's home engine; without an image id, the least loaded engine (the
        fewest calls in flight from this frontend; ties in turn)."""
        engines = self.engines
        if len(engines) == 1:
            return engines[0]
        if image_id is not None:
            return engines[rendezvous_hash(image_id, range(len(engines)))]
        first = next(self._turns) % len(engines)
        turn = engines[first:] + engines[:first]
        return min(turn, key=lambda link: link.in_flight)  # min keeps the first of equals

    # -- the connections ----------------------------------------------------------------

    async def _connect(self, link: EngineLink) -> None:
        """Connect to `link`'s engine, trying again every 20 ms until it listens (engines
        bind while the frontends start) and 20 ms after each connection ends. While one
        holds this waits on `link.lost`: a 20 ms poll of every link woke each frontend's
        loop 50 times a second per engine."""
        while not self._closing:
            link.lost.clear()
            connection = wire.Framed(
                lambda _, frames: self._on_message(link, frames),
                lambda lost: self._on_lost(link, lost),
            )
            with contextlib.suppress(OSError):  # not listening yet (no file, or refused)
                await wire.connect(link.address, connection)
            if connection.transport is not None:  # connected, and not lost meanwhile
                link.connection = connection
                log.debug("connected to engine %d at %s", link.index, link.address)
                await link.lost.wait()
            await asyncio.sleep(0.02)

    def _on_message(self, link: EngineLink, frames: list[bytes]) -> None:
        head, *payload = frames
        if head == RELEASE:
            if self.pixels is not None:
                for slot in load(payload):
                    self.pixels.release(slot)
            return
        future = link.waiting.pop(call_id_of(head), None)
        if future is not None and not future.done():
            future.set_result((load(payload), time.perf_counter()))

    def _on_lost(self, link: EngineLink, lost: wire.Framed) -> None:
        """The engine's end closed: its answers to the calls in flight will not come."""
        if link.connection is lost:
            link.connection = None
        link.lost.set()
        if not self._closing:
            log.warning("the connection to engine %d was lost", link.index)
            self._fail_waiting(link, ServiceError(503, "not_ready", "the engine went away"))

    async def _send(self, link: EngineLink, frames: list[Any], reply: asyncio.Future[Any]) -> None:
        """Send `frames` to `link`'s engine; wait (briefly, repeatedly) while they cannot go
        (not connected yet, or the engine has left `wire.MAX_QUEUED_BYTES` unread), until
        the call's `reply` is settled otherwise (its deadline)."""
        pause = 0.001
        while not reply.done():
            connection = link.connection
            if connection is not None and connection.send(frames):
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    async def _call(
        self,
        call: object,
        deadline: float | None,
        link: EngineLink,
        timing: dict[str, float] | None = None,
    ) -> Reply:
        """The engine's reply; `timing`, when given, gets `engine_wire` (the call pickled,
        sent, answered and read back: `server.http.timing`) and the reply's own timings."""
        assert self._tasks, "start() the client first"
        started = time.perf_counter()
        call_id = next(self._ids)
        call = tracing.stamp(call)  # the current span's traceparent, when tracing is on
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Reply, float]] = loop.create_future()
        link.waiting[call_id] = future
        # a timer on the future rather than asyncio.wait_for (a task and callbacks more)
        timer = None
        if deadline is not None:
            timer = loop.call_at(
                loop.time() + deadline - time.monotonic() + DEADLINE_GRACE_S, _expire, future
            )
        try:
            sent = None if isinstance(call, StatusCall) else time.monotonic()
            await self._send(link, [call_id_bytes(call_id, sent), *dump(call)], future)
            reply, read_at = await future
            if timing is not None:
                timing["engine_wire"] = round((read_at - started) * 1000, 3)
                timing.update(reply.timing_ms)
            return reply
        except TimeoutError:
            self._cancel(link, call_id)
            # the code every other 504 of a passed deadline has: a client sees one code for
            # one condition, whichever side noticed it first
            raise ServiceError(
                504,
                "deadline_exceeded",
                "the request's deadline passed: the engine did not answer in time",
            ) from None
        except asyncio.CancelledError:
            self._cancel(link, call_id)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _cancel(self, link: EngineLink, call_id: int) -> None:
        link.waiting.pop(call_id, None)
        if link.connection is not None:  # not sent: the engine drops the call later anyway
            link.connection.send([call_id_bytes(0), *dump(CancelCall(call_id))])

    async def _value(
        self,
        call: object,
        deadline: float | None,
        image_id: str | None,
        timing: dict[str, float] | None = None,
    ) -> Any:
        """The call's answer from the engine `image_id` routes to (see `engine_for`)."""
        link = self.engine_for(image_id)
        link.in_flight += 1
        try:
            reply = await self._call(call, deadline, link, timing)
        finally:
            link.in_flight -= 1
        if reply.failure is not None:
            raise reply.failure.error()
        return reply.value

    def _image(self, image: Image) -> ImageMsg:
        pixels: Any = image.pixels
        ref = self.pixels.ref(pixels) if self.pixels is not None else pixels
        return ImageMsg(image.image_id, image.width, image.height, ref, jpeg=image.jpeg)

    # -- the engine's API, as routes use it ---------------------------------------------

    # `timing`, when given, gets the call's `engine_wire` and `engine` (`_call`)

    async def segment(
        self, request: SegmentRequest, timing: dict[str, float] | None = None
    ) -> SegmentResult:
        image_id = request.image.image_id if request.image is not None else request.image_id
        if request.image is not None:
            request = replace(request, image=self._image(request.image))  # type: ignore[arg-type]
        call = SegmentCall(request)
        result: SegmentResult = await self._value(call, request.deadline, image_id, timing)
        return result

    async def embed(
        self, image: Image, deadline: float | None = None, timing: dict[str, float] | None = None
    ) -> EmbedResult:
        call = EmbedCall(self._image(image), deadline)
        result: EmbedResult = await self._value(call, deadline, image.image_id, timing)
        return result

    async def lookup(self, image_id: str, timing: dict[str, float] | None = None) -> EmbedResult:
        call = LookupCall(image_id)
        result: EmbedResult = await self._value(call, time.monotonic() + 10.0, image_id, timing)
        return result

    async def classify(
        self,
        image: Image,
        top_k: int,
        deadline: float | None = None,
        timing: dict[str, float] | None = None,
    ) -> ClassifyResult:
        call = ClassifyCall(self._image(image), top_k, deadline)
        # no cache: any engine
        result: ClassifyResult = await self._value(call, deadline, None, timing)
        return result

    async def everything(
        self,
        image: Image | None,
        image_id: str | None,
        fields: dict[str, float | int],
        output: str = "rle",
        deadline: float | None = None,
        timing: dict[str, float] | None = None,
    ) -> Any:
        """(image_id, width, height, EverythingMasks, timing)."""
        message = self._image(image) if image is not None else None
        home = image.image_id if image is not None else image_id
        call = EverythingCall(message, image_id, fields, output, deadline)
        return await self._value(call, deadline, home, timing)

    async def embedding_file(self, image_id: str) -> EmbeddingFile:
        """The cached embedding as SAM's `.npy` or SAM 2's `.npz`, with its sizes."""
        value: EmbeddingFile = await self._value(
            EmbeddingFileCall(image_id), time.monotonic() + 30.0, image_id
        )
        return value
