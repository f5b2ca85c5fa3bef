"""`TraceMiddleware`: the server span of each request, when tracing is on (`server.tracing`).

Pure ASGI, like the others (server/http/middleware.py), and added by `build_app` only when
tracing is on, so an untraced service pays nothing for it. It sits just inside
`ObserveMiddleware`, which has matched the route template (the span's name, `POST
/v1/segment`, stays one per route whatever the path) and the request id; requests refused
by the middleware inside it (401, 413, 408) get their span too. Probes and scrapes get
none: every few seconds per pod, they would bury the requests.

A client's W3C `traceparent` makes the span its child; the answer carries `traceresponse`
(W3C Trace Context Level 2, a draft: `00-<trace id>-<span id>-<flags>`), so a client that
sent none can still find its trace.
"""

from __future__ import annotations

from typing import Any

from server import tracing
from server.errors import clip
from server.http.middleware import (
    MAX_LOGGED_PATH,
    PROBE_PATHS,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
)

_PROPAGATED = (b"traceparent", b"tracestate")


class TraceMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        route = state.get("route", "unmatched")
        method = scope["method"]
        carrier: dict[str, str] = {}
        declared: int | None = None
        for key, value in scope.get("headers", []):
            key = key.lower()
            if key in _PROPAGATED:
                carrier[key.decode("latin-1")] = value.decode("latin-1")
            elif key == b"content-length" and value.isdigit():
                declared = int(value)
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": clip(scope["path"], MAX_LOGGED_PATH),
            "url.scheme": scope.get("scheme", "http"),
        }
        if route != "unmatched":
            attributes["http.route"] = route
        if "request_id" in state:
            attributes["serve.request_id"] = state["request_id"]
        name = f"{method} {route}" if route != "unmatched" else method
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        with tracing.server_span(name, carrier, attributes) as span:
            trace_id, span_id, flags = span.ids()
            state["trace_id"] = trace_id  # for the access log line
            traceresponse = f"00-{trace_id}-{span_id}-{flags:02x}".encode("latin-1")

            async def send_wrapper(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_status(message["status"])
                    message["headers"] = [
                        *message.get("headers", []),
                        (b"traceresponse", traceresponse),
                    ]
                await send(message)

            try:
                await self.app(scope, counting_receive, send_wrapper)
            finally:
                size = declared if declared is not None else received
                span.set_attribute("http.request.body.size", size)
