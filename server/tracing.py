"""OpenTelemetry traces of each request and its phases, exported over OTLP when asked for.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and
`OTEL_SDK_DISABLED` is not `true`: each process (every frontend, the engine) gets its own
`TracerProvider` with a batching OTLP/HTTP (protobuf) exporter; the exporter reads the
other standard `OTEL_EXPORTER_OTLP_*` variables itself (headers, timeout, certificates),
and the sampler `OTEL_TRACES_SAMPLER`. These variables are OpenTelemetry's convention, the
one a platform team sets on every service, so they are read here and not as `SERVE_`
settings (the one exception to "no module reads the environment").

Off, nothing of OpenTelemetry is imported (the service runs where it is not installed),
the frontend has no tracing middleware, and every `span()` below is one global read
returning a shared null context.

The provider is this module's, never OpenTelemetry's global one: FastAPI 0.142+ starts
its own server spans from a configured global provider, which would double ours.

Spans of a request (docs/OBSERVABILITY.md): the frontend's server span `POST /v1/segment`
(a child of the client's W3C `traceparent` when one came); under it `image.decode`, the
client span `engine/segment` (the call's `traceparent` goes to the engine, whose server
span `engine/segment` is its child) with `engine.encode`, `engine.decode`, ... laid out
from the engine's `timing_ms`, and `mask.encode`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from server.errors import ServiceError

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "sam-swin-serve"
TRACER_NAME = "server"
# At exit each process waits this long at most for its last spans to be exported (the
# frontends, then the engine: twice this is within the shutdown's spare time).
FLUSH_AT_EXIT_S = 2.0

T = TypeVar("T")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on, else None
_provider: Any = None  # the TracerProvider `setup` made (shut down at exit)


def wanted(environ: Mapping[str, str]) -> bool:
    """Does the environment ask for traces (an OTLP endpoint, and the SDK not disabled)?"""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return bool(endpoint) and environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def setup(process: str, environ: Mapping[str, str] | None = None) -> bool:
    """Start exporting this process's spans if the environment asks; True when on.

    `process` names it in the resource (`frontend-0`, `engine`). Asked for but not
    installed: one error line, and the service runs untraced (traces are never worth an
    outage).
    """
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.error("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed "
                  "(%s): serving without traces; pip install opentelemetry-sdk "
                  "opentelemetry-exporter-otlp-proto-http", exc)  # fmt: skip
        return False
    resource = Resource.create(
        {
            "service.name": environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
            "serve.role": process.split("-")[0],  # frontend or engine
            "serve.process": process,
            "process.pid": os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    # the endpoint as the exporter would derive it, from the `environ` that decided
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or (
        environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    enable(provider)
    log.info("tracing on: spans exported to %s", endpoint)
    return True


def enable(provider: Any) -> None:
    """Trace with `provider` (an SDK `TracerProvider`; tests pass one with an in-memory
    exporter). Call before `build_app`: the app adds its middleware only when on."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME)


def shutdown(timeout_s: float = FLUSH_AT_EXIT_S) -> None:
    """Export what is batched and stop: a process's last step, so its last spans are not
    lost. Bounded: with the collector unreachable the exporter retries for up to its
    timeout (10 s), which the pod's shutdown budget (docs/DEPLOYMENT.md) cannot spare."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is None:
        return
    flush = threading.Thread(target=provider.shutdown, name="trace-flush", daemon=True)
    flush.start()
    flush.join(timeout_s)
    if flush.is_alive():
        log.warning("the last spans were not exported within %.0f s (is the OTLP collector "
                    "reachable?); exiting without them", timeout_s)  # fmt: skip


def enabled() -> bool:
    return _tracer is not None


class _NullSpan:
    """What every context below yields while tracing is off: one object, no work."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def engine_timing(self, timing_ms: Mapping[str, float]) -> None:
        pass


_NULL = _NullSpan()


class Span:
    """A started span, with what this service adds to it."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def ids(self) -> tuple[str, str, int]:
        """(trace id, span id, trace flags) as W3C headers write them."""
        context = self.span.get_span_context()
        return f"{context.trace_id:032x}", f"{context.span_id:016x}", int(context.trace_flags)

    def set_status(self, status: int) -> None:
        """The HTTP status of a server span's answer (5xx: the span failed)."""
        from opentelemetry.trace import StatusCode

        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(StatusCode.ERROR)
            self.span.set_attribute("error.type", str(status))

    def engine_timing(self, timing_ms: Mapping[str, float]) -> None:
        """The engine's phases (`timing_ms` of its reply: encode, decode, ...) as child
        spans `engine.<phase>`, laid end to end in the reply's order and ending now (the
        reply has just arrived). A phase's queue wait (`<phase>_queue`, part of the phase)
        is a child `engine.<phase>.queue` at the phase's start. The engine measures them on
        its own clock, so these are placed, not recorded: `serve.derived` says so."""
        from opentelemetry import trace

        numbers = {
            k: float(v)
            for k, v in timing_ms.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        phases = [(k, ms) for k, ms in numbers.items() if not k.endswith("_queue")]
        end = time.time_ns()
        start = end - int(sum(ms for _, ms in phases) * 1e6)
        parent = trace.set_span_in_context(self.span)
        for phase, ms in phases:
            stop = start + int(ms * 1e6)
            child = _tracer.start_span(
                f"engine.{phase}",
                context=parent,
                start_time=start,
                attributes={"serve.derived": True, "serve.duration_ms": ms},
            )
            queued = numbers.get(f"{phase}_queue")
            if queued is not None:
                wait = _tracer.start_span(
                    f"engine.{phase}.queue",
                    context=trace.set_span_in_context(child),
                    start_time=start,
                    attributes={"serve.derived": True, "serve.duration_ms": queued},
                )
                wait.end(end_time=min(stop, start + int(queued * 1e6)))
            child.end(end_time=stop)
            start = stop


def server_span(
    name: str, headers: Mapping[str, str], attributes: dict[str, Any]
) -> AbstractContextManager[Span]:
    """A request's server span (tracing on only): a child of the W3C `traceparent` (and
    `tracestate`) in `headers` when the client sent one, else the root of a new trace."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(headers)
    return _started(name, attributes, kind="server", parent=parent)


def span(name: str, **attributes: Any) -> AbstractContextManager[Span | _NullSpan]:
    """A child span of the current one for a phase of this process's work (`image.decode`,
    `mask.encode`); off, or with no request span around it, the shared null context."""
    if _tracer is None:
        return _NULL
    return _started(name, attributes, kind="internal")


def _rpc(call: str) -> tuple[str, dict[str, Any]]:
    """An engine call's span name and attributes, by OpenTelemetry's RPC convention
    (`service/method`, the same on the client and the server side): `engine/segment`. Not
    `engine.segment`: the engine's phases are `engine.<phase>`, and one is `classify`."""
    return f"engine/{call}", {
        "rpc.system": "unix_socket",
        "rpc.service": "engine",
        "rpc.method": call,
    }


def engine_call(call: str) -> AbstractContextManager[Span | _NullSpan]:
    """The frontend's client span around one engine call (`engine/segment`): `stamp` gives
    its context to the call, `engine_timing` lays the engine's phases in it."""
    if _tracer is None:
        return _NULL
    name, attributes = _rpc(call)
    return _started(name, attributes, kind="client")


def _current_is_valid() -> bool:
    from opentelemetry import trace

    return bool(trace.get_current_span().get_span_context().is_valid)


@contextmanager
def _started(name: str, attributes: dict[str, Any], kind: str, parent: Any = None) -> Iterator[Any]:
    """A span made current for the block. A phase outside any request span (a status poll,
    a start-up step) is not traced: only requests are."""
    from opentelemetry.trace import SpanKind

    if parent is None and not _current_is_valid():
        yield _NULL
        return
    with _tracer.start_as_current_span(
        name,
        context=parent,
        kind=getattr(SpanKind, kind.upper()),
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as started:
        try:
            yield Span(started)
        except BaseException as exc:
            failed(started, exc)
            raise


def failed(started: Any, exc: BaseException) -> None:
    """Mark a span by how its work ended: a client's error (4xx, a cancel) is an answer
    and sets only `error.type`; a server's (5xx, an unexpected exception) is an error."""
    from opentelemetry.trace import StatusCode

    if isinstance(exc, ServiceError):
        started.set_attribute("error.type", exc.code)
        if exc.status >= 500:
            started.set_status(StatusCode.ERROR, exc.message)
    elif isinstance(exc, asyncio.CancelledError):
        started.set_attribute("error.type", "cancelled")
    elif isinstance(exc, Exception):
        started.record_exception(exc)
        started.set_attribute("error.type", type(exc).__qualname__)
        started.set_status(StatusCode.ERROR, type(exc).__name__)


# -- crossing to the engine ------------------------------------------------------------


def stamp(call: T) -> T:
    """`call` with the current span's W3C `traceparent`, for the engine to continue the
    trace (calls are frozen dataclasses with a `traceparent` field); as is when off."""
    if _tracer is None or not hasattr(call, "traceparent"):
        return call
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    header = carrier.get("traceparent")
    return replace(call, traceparent=header) if header else call  # type: ignore[type-var]


def engine_span(call: object) -> AbstractContextManager[Span | _NullSpan]:
    """In the engine: the server span of one call (`engine/segment`), a child of the
    frontend's client span by the call's `traceparent`; calls without one are not traced."""
    traceparent = getattr(call, "traceparent", None)
    if _tracer is None or not traceparent:
        return _NULL
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    kind = type(call).__name__.removesuffix("Call")  # EmbeddingFileCall: embedding_file
    name, attributes = _rpc(re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower())
    return _started(name, attributes, kind="server", parent=parent)
