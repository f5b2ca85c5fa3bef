"""Traces (server/tracing.py): a request's spans, a client's `traceparent` honoured and
carried to the engine, OTLP export from every process, and nothing at all when off.

The in-memory tests run the app in this process with its engine on a thread, so one
exporter sees the frontend's spans and the engine's; the last test runs `python -m server`
against a local OTLP receiver, as a collector would see it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from server import tracing
from server.http.trace_middleware import TraceMiddleware
from tests.server.conftest import (
    ROOT,
    LiveServer,
    free_port,
    small_settings,
    spawn_server,
    wait_until_ready,
)

BOX = {"box": [40, 30, 200, 180]}


def segment(url: str, image: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    files = {"image": ("image.jpg", image, "image/jpeg")}
    return httpx.post(
        url + "/v1/segment",
        files=files,
        data={"request": json.dumps(BOX)},
        headers=headers or {},
        timeout=60,
    )


def traceparent() -> tuple[str, str, str]:
    """A client's W3C traceparent: (header, trace id, parent span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[LiveServer, InMemorySpanExporter]]:
    """A server built with tracing on, exporting into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    server = LiveServer(small_settings())
    try:
        server.start()
        yield server, exporter
    finally:
        server.stop()
        tracing.shutdown()


def spans_of(exporter: InMemorySpanExporter, trace_id: str, names: set[str]) -> list[ReadableSpan]:
    """The trace's spans once every name in `names` has ended (the server span ends just
    after the response's last byte, so it may lag the client a little)."""
    deadline = time.monotonic() + 10
    while True:
        spans = [
            s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
        ]
        if names <= {label(s) for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def label(span: Any) -> str:
    """A span's name, with its kind for the engine calls: `engine/segment` is the name of
    both the frontend's client span and the engine's server span (the RPC convention)."""
    if not span.name.startswith("engine/"):
        return str(span.name)
    kind = span.kind if isinstance(span.kind, SpanKind) else PROTO_KINDS[span.kind]
    return f"{span.name}:{kind.name.lower()}"


PROTO_KINDS = {2: SpanKind.SERVER, 3: SpanKind.CLIENT}  # OTLP's SPAN_KIND_* numbers


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if label(s) == name]
    assert len(found) == 1, (name, [label(s) for s in spans])
    return found[0]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> set[str]:
    parent_id = parent.context.span_id
    return {label(s) for s in spans if s.parent is not None and s.parent.span_id == parent_id}


CLIENT, SERVER = "engine/segment:client", "engine/segment:server"
ALL = {"POST /v1/segment", "image.decode", CLIENT, SERVER, "mask.encode"}


def test_segment_continues_the_clients_trace(traced, jpeg_bytes):
    server, exporter = traced
    header, trace_id, parent_id = traceparent()
    response = segment(server.url, jpeg_bytes, {"traceparent": header})
    assert response.status_code == 200, response.text
    spans = spans_of(exporter, trace_id, ALL)

    root = one(spans, "POST /v1/segment")
    assert root.kind == SpanKind.SERVER
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id
    assert root.parent.is_remote
    attributes = dict(root.attributes or {})
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/v1/segment"
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.request.body.size"] == int(response.request.headers["content-length"])
    assert attributes["serve.request_id"] == response.headers["x-request-id"]
    assert root.status.status_code == StatusCode.UNSET
    # the answer names the span, so a client can find it (W3C traceresponse)
    assert response.headers["traceresponse"] == f"00-{trace_id}-{root.context.span_id:016x}-01"

    assert children(spans, root) == {"image.decode", CLIENT, "mask.encode"}
    call = one(spans, CLIENT)
    assert call.kind == SpanKind.CLIENT
    assert dict(call.attributes or {})["rpc.method"] == "segment"
    assert dict(call.attributes or {})["rpc.service"] == "engine"
    # the engine's span came through the call's traceparent (it crossed the engine's socket)
    assert children(spans, call) == {SERVER, "engine.encode", "engine.decode"}
    served = one(spans, SERVER)
    assert served.kind == SpanKind.SERVER and served.parent is not None
    assert served.parent.is_remote
    # the engine's own phases, placed from its timing_ms inside the call, in order
    timing = response.json()["timing_ms"]
    encode, decode = one(spans, "engine.encode"), one(spans, "engine.decode")
    for derived, phase in ((encode, "encode"), (decode, "decode")):
        assert derived.start_time is not None and derived.end_time is not None
        assert call.start_time is not None and call.end_time is not None
        assert call.start_time <= derived.start_time <= derived.end_time <= call.end_time
        ms = (derived.end_time - derived.start_time) / 1e6
        assert ms == pytest.approx(timing[phase], abs=0.01)
    assert encode.end_time == decode.start_time
    # each phase's wait for a batch, from the engine's timing, at the phase's start
    assert timing["decode_queue"] <= timing["decode"]
    waited = one(spans, "engine.decode.queue")
    assert waited.parent is not None and waited.parent.span_id == decode.context.span_id
    assert waited.start_time == decode.start_time and waited.end_time is not None
    assert (waited.end_time - waited.start_time) / 1e6 == pytest.approx(
        timing["decode_queue"], abs=0.01
    )


def test_without_traceparent_a_new_trace_starts(traced, jpeg_bytes, caplog):
    server, exporter = traced
    caplog.set_level(logging.INFO, logger="server.access")
    response = segment(server.url, jpeg_bytes)
    assert response.status_code == 200, response.text
    version, trace_id, span_id, flags = response.headers["traceresponse"].split("-")
    assert version == "00" and int(trace_id, 16) != 0
    assert int(flags, 16) & 1  # sampled (0x02, a random trace id, may be set too)
    spans = spans_of(exporter, trace_id, ALL)
    root = one(spans, "POST /v1/segment")
    assert root.parent is None and f"{root.context.span_id:016x}" == span_id
    assert {label(s) for s in spans} >= ALL  # the engine's span joined the new trace
    # the access log line (written just after the span ends) leads to the trace
    request_id = response.headers["x-request-id"]
    deadline = time.monotonic() + 5
    while True:
        lines = [
            r
            for r in caplog.records
            if r.name == "server.access" and getattr(r, "request_id", None) == request_id
        ]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert [getattr(r, "trace_id", None) for r in lines] == [trace_id]


def test_refusals_are_traced_and_probes_are_not(traced, jpeg_bytes):
    server, exporter = traced
    header, trace_id, _ = traceparent()
    files = {"image": ("image.jpg", jpeg_bytes, "image/jpeg")}
    bad = httpx.post(
        server.url + "/v1/segment",
        files=files,
        data={"request": json.dumps({"box": [10, 10, 5, 5]})},  # x1 < x0
        headers={"traceparent": header},
        timeout=60,
    )
    assert bad.status_code == 422, bad.text
    root = one(spans_of(exporter, trace_id, {"POST /v1/segment"}), "POST /v1/segment")
    attributes = dict(root.attributes or {})
    assert attributes["http.response.status_code"] == 422
    assert root.status.status_code == StatusCode.UNSET  # the client's error, not the server's

    before = len(exporter.get_finished_spans())
    header, trace_id, _ = traceparent()
    for path in ("/healthz", "/readyz", "/metrics"):
        probe = httpx.get(server.url + path, headers={"traceparent": header}, timeout=10)
        assert probe.status_code == 200
        assert "traceresponse" not in probe.headers
    time.sleep(0.2)
    assert len(exporter.get_finished_spans()) == before


# -- off --------------------------------------------------------------------------------

OFF_SCRIPT = """
import json, sys
# as where OpenTelemetry's SDK and exporter are not installed: importing them fails
for name in ("opentelemetry.sdk", "opentelemetry.exporter"):
    sys.modules[name] = None
import httpx
from server import tracing
from tests.server.conftest import LiveServer, small_settings

no_endpoint = tracing.setup("frontend-0", {})
not_installed = tracing.setup("frontend-0", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
server = LiveServer(small_settings()).start()
try:
    image = open(sys.argv[1], "rb").read()
    r = httpx.post(server.url + "/v1/segment", files={"image": ("a.jpg", image, "image/jpeg")},
                   data={"request": json.dumps({"box": [10, 10, 100, 100]})},
                   headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}, timeout=60)
    middleware = [m.cls.__name__ for m in server.app.user_middleware]
finally:
    server.stop()
print(json.dumps({
    "status": r.status_code, "traceresponse": r.headers.get("traceresponse"),
    "no_endpoint": no_endpoint, "not_installed": not_installed, "enabled": tracing.enabled(),
    "middleware": middleware,
    "sdk_loaded": sorted(m for m in sys.modules
                         if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))
                         and sys.modules[m] is not None),
}))
"""


def test_off_costs_nothing_and_needs_no_sdk(tmp_path, jpeg_bytes):
    """No endpoint: no provider, no middleware, no spans, and the SDK never imported; with
    the endpoint set but the SDK missing, the service still serves (untraced)."""
    image = tmp_path / "a.jpg"
    image.write_bytes(jpeg_bytes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, str(image)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 200
    assert result["traceresponse"] is None
    assert result["no_endpoint"] is False and result["not_installed"] is False
    assert result["enabled"] is False
    assert TraceMiddleware.__name__ not in result["middleware"]
    assert result["sdk_loaded"] == []
    assert "OpenTelemetry is not installed" in done.stderr  # the one line saying why


def test_wanted_reads_the_standard_variables():
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing.wanted(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}
    )


def test_exit_waits_boundedly_for_an_unreachable_collector(caplog):
    """A process's last flush cannot hold its exit (and the pod's shutdown) for the
    exporter's retries: nothing listens at the endpoint, the flush gives up in time."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    assert tracing.setup("engine", {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    try:
        with tracing.server_span("GET /x", {}, {}):
            pass
    finally:
        started = time.monotonic()
        tracing.shutdown(timeout_s=0.5)
    assert time.monotonic() - started < 1.5
    assert not tracing.enabled()
    assert "the last spans were not exported" in caplog.text


# -- OTLP from the real processes -------------------------------------------------------


class Collector:
    """A stand-in OTLP/HTTP collector: keeps every `POST /v1/traces` body, answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.paths.append(self.path)
                if self.path == "/v1/traces":
                    collector.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) for every span received."""
        out = []
        for body in list(self.bodies):
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource_spans in request.resource_spans:
                resource = {
                    a.key: a.value.string_value or a.value.int_value
                    for a in resource_spans.resource.attributes
                }
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource, span) for span in scope_spans.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_python_m_server_exports_over_otlp(tmp_path, jpeg_bytes):
    collector = Collector()
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "SERVE_DEVICE": "cpu",
        "SERVE_SAM_MODEL": "vit_tiny",
        "SERVE_SWIN_MODEL": "swin_test",
        "SERVE_MAX_BATCH_SIZE": "2",
        "SERVE_BATCH_BUCKETS": "[1,2]",
        "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
        "SERVE_HTTP_WORKERS": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_SERVICE_NAME": "segment-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon, not every 5 s
    }
    header, trace_id, parent_id = traceparent()
    with log_path.open("w+") as log:
        proc = spawn_server(env, port, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(proc, url, log_path, 240)
            response = segment(url, jpeg_bytes, {"traceparent": header})
            assert response.status_code == 200, response.text
            deadline = time.monotonic() + 30
            while True:
                received = [
                    (res, s) for res, s in collector.spans() if s.trace_id.hex() == trace_id
                ]
                names = {label(s) for _, s in received}
                if names >= ALL or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            collector.close()
    assert names >= ALL, (names, collector.paths, log_path.read_text()[-3000:])
    by_name = {label(s): (res, s) for res, s in received}
    frontend, root = by_name["POST /v1/segment"]
    engine, served = by_name[SERVER]
    assert root.parent_span_id.hex() == parent_id
    assert served.parent_span_id == by_name[CLIENT][1].span_id  # across processes
    assert frontend["service.name"] == engine["service.name"] == "segment-test"
    assert (frontend["serve.role"], engine["serve.role"]) == ("frontend", "engine")
    assert frontend["serve.process"] == "frontend-0"
    assert frontend["process.pid"] != engine["process.pid"]
    assert proc.returncode == 0, log_path.read_text()[-3000:]
