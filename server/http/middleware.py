"""Pure ASGI middleware (BaseHTTPMiddleware would break disconnect detection).

- `ObserveMiddleware`: request id (honours `X-Request-ID`), duration and status metrics by
  route template, in-flight gauge, one structured log line per request; the instant the
  request reached the app (`state["received"]`, where `timing_ms.frontend` starts).
- `BodyLimitMiddleware`: refuses bodies over the byte limit with 413 before they are
  buffered, by `Content-Length` when given and by counting otherwise, and bodies that have
  not arrived within the request deadline with 408 (a stalled upload would otherwise hold
  its request, and the drain at shutdown, for as long as the client liked).
- `ApiKeyMiddleware`: `Authorization: Bearer` or `X-API-Key`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from starlette.routing import Match

from server.errors import clip, error_body
from server.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Kubelet probes and Prometheus scrapes: answered, counted by route, but not "work".
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

access_log = logging.getLogger("server.access")
# Paths are logged before any check (an unauthenticated 60 KB path is one log line): cut.
MAX_LOGGED_PATH = 256


async def send_error(
    send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> None:
    """Answer with the JSON error envelope straight from middleware."""
    body = json.dumps(error_body(code, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class InFlight(Protocol):
    in_flight: int


class ObserveMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        routes: list[Any],
        counter: InFlight,
        served_by: str = "frontend",
    ) -> None:
        self.app = app
        # which frontend answered (`X-Served-By`): with several behind one port, the one
        # place a client or a test sees which process it reached
        self.served_by = served_by.encode("latin-1")
        self.metrics = metrics
        self.routes = routes
        self.counter = counter  # the drain waits for its in_flight to reach 0
        # (method, path) of a route without parameters -> its template: a few entries
        self._static: dict[tuple[str, str], str] = {}
        # (route, method, status) -> the two metric children a request updates
        self._series: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def _route(self, scope: Scope) -> str:
        """The route template (`/v1/segment`), so metric labels stay few whatever the path.

        Matched before the app runs, so requests refused by inner middleware (413, 401)
        are labelled too. `routes` are the leaf routes (an included router is not one).
        A path that is a route's whole template is remembered (there are few of those);
        others (`/v1/embeddings/{image_id}`, unknown paths) are matched every time.
        """
        key = (scope["method"], scope["path"])
        known = self._static.get(key)
        if known is not None:
            return known
        for route in self.routes:
            path = getattr(route, "path", None)
            if path is not None and route.matches(scope)[0] == Match.FULL:
                if path == scope["path"]:
                    self._static[key] = str(path)
                return str(path)
        return "unmatched"

    def _observe(self, labels: tuple[str, str, str], seconds: float) -> None:
        """Count the request by its labels; each series' children are found once (a
        `labels()` call takes a lock and builds a tuple of strings every time)."""
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = (
                self.metrics.request_seconds.labels(*labels),
                self.metrics.requests.labels(*labels),
            )
        series[0].observe(seconds)
        series[1].inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = (_header(scope, b"x-request-id") or uuid.uuid4().hex)[:128]
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["received"] = started  # a response's `timing_ms.frontend` counts from here
        route = state["route"] = self._route(scope)  # TraceMiddleware names by it
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                headers.append((b"x-served-by", self.served_by))
                message["headers"] = headers
            await send(message)

        # Probes and scrapes are not work: an idle server shows 0 to the scrape reading it.
        work = scope["path"] not in PROBE_PATHS
        if work:
            self.metrics.in_flight.inc()
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.counter.in_flight -= 1
            if work:
                self.metrics.in_flight.dec()
            seconds = time.perf_counter() - started
            self._observe((route, scope["method"], str(status)), seconds)
            # probes and scrapes every few seconds would bury everything else at INFO
            access_log.log(
                logging.DEBUG if scope["path"] in PROBE_PATHS else logging.INFO,
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": clip(scope["path"], MAX_LOGGED_PATH),
                    "route": route,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                    **_phases(scope),
                },
            )


def _phases(scope: Scope) -> dict[str, Any]:
    """The route's own timings (`request.state.timing_ms`) and, when traced, the trace id
    (the log line's way to its trace), for the access log line."""
    state = scope.get("state", {})
    extra = {"timing_ms": state["timing_ms"]} if state.get("timing_ms") else {}
    if "trace_id" in state:
        extra["trace_id"] = state["trace_id"]
    return extra


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._reading: set[_BodyClock] = set()  # requests whose body is still arriving
        self._reaper: asyncio.Task[None] | None = None

    async def _refuse(self, send: Send, size: str) -> None:
        self.metrics.rejections.labels("bad_input").inc()
        await send_error(
            send, 413, "payload_too_large", f"body of {size} is over the limit of "
            f"{self.max_bytes} bytes",
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, f"{declared} bytes")
            return
        seen = 0
        started = False
        clock = _BodyClock(self.timeout_s)

        async def guarded_receive() -> Message:
            nonlocal seen
            if clock.done:  # the body is in: later reads wait for a disconnect, unbounded
                return await receive()
            if clock.expired:
                raise _BodyTimeoutError()
            if not clock.watched:
                self._watch(clock)
            clock.reader = task = asyncio.current_task()
            try:
                message = await receive()
            except asyncio.CancelledError:
                # The reaper's alone (nobody else cancelled the task too): the body is late.
                if clock.expired and task is not None and task.uncancel() == 0:
                    raise _BodyTimeoutError() from None
                raise
            finally:
                clock.reader = None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLargeError()
                if not message.get("more_body", False):
                    clock.done = True
                    self._reading.discard(clock)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except _BodyTooLargeError:
            if not started:
                await self._refuse(send, f"more than {self.max_bytes} bytes")
        except _BodyTimeoutError:
            if not started:
                self.metrics.rejections.labels("bad_input").inc()
                await send_error(
                    send, 408, "body_timeout",
                    f"the request body did not arrive within {self.timeout_s:g} s",
                    headers={"Connection": "close"},  # what is still coming is not read
                )  # fmt: skip
        finally:
            self._reading.discard(clock)

    def _watch(self, clock: _BodyClock) -> None:
        """Count `clock` among the bodies being read; start the reaper if none runs."""
        clock.watched = True
        self._reading.add(clock)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="body-reaper")

    async def _reap(self) -> None:
        """Expire the bodies past their deadline; end when none is left (`_watch` starts
        the next), so an idle server has no task waking up."""
        while self._reading:
            await asyncio.sleep(_REAP_PERIOD_S)
            now = time.monotonic()
            for clock in [c for c in self._reading if c.deadline <= now]:
                self._reading.discard(clock)
                clock.expire()


class _BodyTooLargeError(Exception):
    pass


class _BodyTimeoutError(Exception):
    pass


class _BodyClock:
    """The body deadline of one request. No timer of its own: a timer per request (or an
    `asyncio.timeout` per read) cost more than the rest of this middleware, so one reaper
    task per app expires late bodies (`_REAP_PERIOD_S`), cancelling the read in progress
    as `asyncio.timeout` does (`guarded_receive` then raises `_BodyTimeoutError`)."""

    __slots__ = ("deadline", "done", "expired", "reader", "watched")

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s  # from the request's start
        self.done = False
        self.expired = False
        self.watched = False  # counted among the bodies the reaper looks at
        self.reader: asyncio.Task[Any] | None = None

    def expire(self) -> None:
        self.expired = True
        if self.reader is not None:
            self.reader.cancel()


# How often the reaper looks: a late body is refused up to this long after its deadline.
_REAP_PERIOD_S = 0.25


OPEN_PATHS = frozenset({"/healthz", "/readyz"})
PAGE_PATHS = frozenset({"/", "/favicon.ico"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics: Metrics, metrics_open: bool) -> None:
        self.app = app
        self.key = api_key.encode()
        self.metrics = metrics
        self.open = set(OPEN_PATHS | PAGE_PATHS)
        if metrics_open:
            self.open.add("/metrics")

    def _authorized(self, scope: Scope) -> bool:
        given = _header(scope, b"x-api-key")
        auth = _header(scope, b"authorization")
        if given is None and auth is not None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if given is None:
            return False
        return hmac.compare_digest(given.encode("latin-1", "replace"), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in self.open
            or scope["path"].startswith("/static/")
        ):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.metrics.rejections.labels("unauthorized").inc()
        await send_error(
            send, 401, "unauthorized",
            "missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key'",
            headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
