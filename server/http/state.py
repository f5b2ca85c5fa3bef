"""What a frontend holds between requests: settings, the engine client, metrics, flags.

Kept on `app.state.serve`. Readiness, a start-up failure and a stuck batch are the engine
process's (its last status answer); draining and the requests in flight are this process's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.errors import ServiceError
from server.http.engine_client import EngineClient
from server.http.pixels import SharedPixels
from server.metrics import Metrics
from server.settings import Settings

T = TypeVar("T")


@dataclass
class ServeState:
    settings: Settings
    metrics: Metrics
    decode_pool: ThreadPoolExecutor
    engine: EngineClient | None = None
    pixels: SharedPixels | None = None  # where images are decoded for the engine
    embedded: Any = None  # an engine in this process (server.http.embedded), tests and dev
    engine_address: str | tuple[str, ...] | None = None  # engine sockets; None: embedded
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served (kept by ObserveMiddleware)
    started_at: float = field(default_factory=time.monotonic)
    on_fatal: Callable[[], None] | None = None  # set by the launcher to stop the server
    drain_deadline: float | None = None  # monotonic; the drain waits for no one past it

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    @property
    def failure(self) -> str | None:
        """Why start-up failed (the engine's), or that the engine stopped answering."""
        if self.engine is None or self.engine.status is None:
            return None
        if self.engine.stale:
            return "the engine process is not answering"
        return self.engine.status.failure

    @property
    def stuck(self) -> str | None:
        """Stages whose batch outlived the watchdog (the engine's); /healthz reports it."""
        status = self.engine.status if self.engine is not None else None
        return status.stuck if status is not None else None

    @property
    def progress(self) -> dict[str, Any] | None:
        """The start-up's steps (server.progress's snapshot); /readyz shows them."""
        status = self.engine.status if self.engine is not None else None
        return status.progress if status is not None else None

    def begin_drain(self) -> None:
        """From now on: readiness 503, new requests 503; accepted ones still complete,
        within `drain_timeout_s` from the first call (a second drain adds no time); and
        `serve_ready` 0. On the event loop, never in a signal handler (`refuse_new_work`)."""
        self.refuse_new_work()
        self.metrics.ready.set(0)

    def refuse_new_work(self) -> None:
        """The part of `begin_drain` a signal handler may run: assignments, no lock.

        A handler runs between two bytecodes of whatever the thread was doing. One that set
        the metric took prometheus_client's lock, which the code it interrupted (a request's
        first observation, creating its series) already held: the frontend hung for good
        on SIGTERM (CI, 2026-11-24; its stacks showed both frames in one thread).
        """
        if not self.draining:
            self.drain_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.draining = True

    async def require_engine(self) -> EngineClient:
        """The engine, or 503 while loading, warming, draining or failed. Not ready by the
        last status: asked again first (`EngineClient.refresh`), since /readyz may already
        have said 200 through another frontend whose poll came sooner."""
        if self.draining:
            raise ServiceError(503, "not_ready", "the service is shutting down")
        engine = self.engine
        if engine is None or not (engine.ready or await engine.refresh()):
            raise ServiceError(503, "not_ready", "the service is still loading or warming up")
        if self.draining:  # began while the status was asked
            raise ServiceError(503, "not_ready", "the service is shutting down")
        return engine

    async def in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run CPU work (image decoding, mask encoding) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decode_pool, fn, *args)

    def deadline(self, header: str | None) -> float:
        """The request's monotonic deadline: the setting, or what the header asks for, up to
        the maximum setting (a long job on a slow device asks for more; a client that gives
        up sooner asks for less, and its abandoned work is dropped at its deadline)."""
        seconds = self.settings.request_timeout_s
        longest = max(seconds, self.settings.max_request_timeout_s)
        if header:
            try:
                asked = float(header) / 1000.0
            except ValueError:
                raise ServiceError(
                    422, "invalid_request", "X-Request-Timeout-Ms must be a number"
                ) from None
            if not asked > 0:
                raise ServiceError(422, "invalid_request", "X-Request-Timeout-Ms must be > 0")
            seconds = min(asked, longest)
        return time.monotonic() + seconds


def serve_state(app_state: object) -> ServeState:
    state = getattr(app_state, "serve", None)
    if not isinstance(state, ServeState):
        raise RuntimeError("app.state.serve is not set: build the app with build_app()")
    return state


async def watch_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: Awaitable[T]
) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    Cancelling drops the request's queued batch items, so abandoned work is not computed.
    """
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ServiceError(499, "client_closed", "the client closed the connection")
