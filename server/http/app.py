"""`build_app(settings)`: a frontend's routers, middleware, error handlers and lifespan.

The lifespan connects to the engine (its process, or one it starts on a thread) and maps
this process's shared pixel memory; `/healthz` answers at once while `/readyz` stays 503
until the engine reports every bucket warm. On shutdown it stops taking requests, drains
what was accepted, then disconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import disable_created_metrics
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from server.errors import ServiceError, clip, error_body
from server.http import page
from server.http.docs_assets import install_docs
from server.http.engine_client import EngineClient
from server.http.inputs import MAX_ECHOED
from server.http.middleware import (
    MAX_LOGGED_PATH,
    PROBE_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ObserveMiddleware,
)
from server.http.pixels import SharedPixels
from server.http.responses import FastJSONResponse
from server.http.routes import router
from server.http.state import ServeState, serve_state
from server.metrics import Metrics
from server.settings import Settings
from server.threadnames import name_this_thread
from server.tracing import enabled as tracing_enabled

log = logging.getLogger(__name__)

# what a page of another origin may send: X-Image-Id is what proxies route by
_CORS_HEADERS = ["Authorization", "X-API-Key", "Content-Type", "X-Request-ID", "X-Image-Id"]

_REASONS = {
    401: "unauthorized",
    429: "queue_full",
    499: "cancelled",
    503: "not_ready",
    504: "deadline",
    507: "out_of_memory",
}


async def drain(state: ServeState) -> None:
    """Refuse new work (503, readiness off), then wait for accepted requests until the
    drain's deadline (`SERVE_DRAIN_TIMEOUT_S` after the first SIGTERM). Called again by the
    lifespan's shutdown, it waits only for what is left of that time: the shutdown's sum
    (docs/DEPLOYMENT.md) counts the drain timeout once. A request in flight here is also
    one the engine holds for this frontend, so this waits for the engine's share too."""
    state.begin_drain()
    assert state.drain_deadline is not None
    while time.monotonic() < state.drain_deadline:
        if state.in_flight == 0:
            log.info("drained: no request in flight")
            return
        await asyncio.sleep(0.02)
    if state.in_flight:
        log.warning("drain timed out after %.1fs with %d requests in flight",
                    state.settings.drain_timeout_s, state.in_flight)  # fmt: skip


async def watch_engine(state: ServeState) -> None:
    """Stop this frontend when the engine reports a failed start-up (embedded engines only:
    between processes the supervisor sees the engine exit and stops everything)."""
    while True:
        await asyncio.sleep(0.1)
        if state.failure is not None and state.embedded is not None:
            log.error("%s", state.failure)
            if state.on_fatal is not None:
                state.on_fatal()
            return


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = serve_state(app.state)
    settings = state.settings
    address = state.engine_address
    if address is None:  # no engine process: one on a thread here (tests, a laptop)
        from server.engine.embedded import EmbeddedEngine

        state.embedded = EmbeddedEngine(settings, state.metrics)
        await asyncio.get_running_loop().run_in_executor(None, state.embedded.start)
        address = state.embedded.address
    if settings.shm_bytes_per_worker > 0:
        state.pixels = SharedPixels(settings.shm_bytes_per_worker)
    state.engine = EngineClient(address, state.pixels)
    await state.engine.start()
    guard = asyncio.create_task(watch_engine(state), name="watch-engine")
    try:
        yield
    finally:
        guard.cancel()
        await asyncio.gather(guard, return_exceptions=True)
        await drain(state)
        await state.engine.close()
        if state.embedded is not None:
            await asyncio.get_running_loop().run_in_executor(None, state.embedded.stop)
        if state.pixels is not None:
            state.pixels.close()
        state.decode_pool.shutdown(wait=False, cancel_futures=True)


def _install_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> FastJSONResponse:
        if request.url.path in PROBE_PATHS:
            pass  # a probe's 503 during warm-up or drain is an answer, not a refused request
        elif exc.status in _REASONS:
            metrics.rejections.labels(_REASONS[exc.status]).inc()
        elif 400 <= exc.status < 500:
            metrics.rejections.labels("bad_input").inc()
        elif exc.status >= 500:
            metrics.rejections.labels("internal").inc()
        return FastJSONResponse(
            error_body(exc.code, exc.message), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> FastJSONResponse:
        metrics.rejections.labels("bad_input").inc()
        message = "; ".join(
            f"{clip('.'.join(str(p) for p in e['loc']), MAX_ECHOED)}: {e['msg']}"
            for e in exc.errors()
        )
        return FastJSONResponse(error_body("invalid_request", message), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> FastJSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        code = codes.get(exc.status_code, "http_error")
        return FastJSONResponse(
            error_body(code, str(exc.detail)), status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )  # fmt: skip

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect) -> FastJSONResponse:
        """The client left while sending its body: a 499 like any other departure (the
        answer goes nowhere; it is for the access log and the metrics)."""
        metrics.rejections.labels(_REASONS[499]).inc()
        log.info("client disconnected while sending the body of %s",
                 clip(request.url.path, MAX_LOGGED_PATH))  # fmt: skip
        return FastJSONResponse(
            error_body("client_closed", "the client closed the connection"), status_code=499
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> FastJSONResponse:
        metrics.rejections.labels("internal").inc()
        log.exception("unhandled error on %s", clip(request.url.path, MAX_LOGGED_PATH))
        return FastJSONResponse(
            error_body("internal", f"internal error: {type(exc).__name__}"), status_code=500
        )


def build_app(
    settings: Settings,
    metrics: Metrics | None = None,
    engine_address: str | tuple[str, ...] | None = None,
    role: str = "frontend",
) -> FastAPI:
    """The ASGI app for `settings`, a frontend of the engine at `engine_address` (an `ipc://`
    address, or one per engine); without one, its lifespan starts an engine on a thread of
    this process."""
    # No `_created` series: one per counter and histogram child, they double the scrape
    # and no query here uses them. prometheus_client reads this flag (process-wide) at
    # every scrape, so setting it here covers metrics made before as well as after.
    disable_created_metrics()
    metrics = metrics or Metrics()
    app = FastAPI(
        title="SAM + Swin inference service",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # install_docs: the same pages, assets from the package, not a CDN
        redoc_url=None,
    )
    app.state.serve = ServeState(
        settings=settings,
        metrics=metrics,
        decode_pool=ThreadPoolExecutor(
            settings.decode_threads, thread_name_prefix="decode", initializer=name_this_thread
        ),
        engine_address=engine_address,
    )
    app.include_router(router)
    app.include_router(page.router)
    install_docs(app)
    _install_handlers(app, metrics)
    # The last added is outermost: observe everything, CORS before auth, body limit inside.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.request_timeout_s,
        metrics=metrics,
    )
    if settings.api_key:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=settings.api_key,
            metrics=metrics,
            metrics_open=not settings.metrics_require_key,
        )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=_CORS_HEADERS,
        )
    if tracing_enabled():  # server.tracing: on by OTEL_EXPORTER_OTLP_ENDPOINT, else absent
        from server.http.trace_middleware import TraceMiddleware

        app.add_middleware(TraceMiddleware)  # inside ObserveMiddleware: it names the route
    leaf_routes = [*router.routes, *page.router.routes, *app.router.routes]  # + docs
    app.add_middleware(
        ObserveMiddleware,
        metrics=metrics,
        routes=leaf_routes,
        counter=app.state.serve,
        served_by=role,
    )
    return app
