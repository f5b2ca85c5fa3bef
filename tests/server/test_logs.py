"""Structured logs: one JSON access line per request, carrying its request id, route, status,
duration and the route's own timings; the id is the client's `X-Request-ID` or a generated
one, and the response carries it back.

In-process tests read the "server.access" logger of a LiveServer through the service's own
JsonFormatter; one test runs `python -m server` (its logging set up by the launcher, as in
production) with its log in a file and reads every line back.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.logs import JsonFormatter
from tests.server.conftest import (
    encode,
    free_port,
    photo_like,
    spawn_server,
    stop_server,
    wait_until_ready,
)

ROOT = Path(__file__).resolve().parents[2]
BOX = [10, 10, 100, 90]
GENERATED_ID = re.compile(r"[0-9a-f]{32}")
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def b64_png(seed: int) -> str:
    return base64.b64encode(encode(photo_like(120, 90, seed=seed), "PNG")).decode()


class AccessLines(logging.Handler):
    """Collects the access logger's records, formatted exactly as the service writes them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def wait_for(self, request_id: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The parsed lines of one request id; the line is written just after the response."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in map(json.loads, list(self.lines)) if e["request_id"] == request_id]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.01)


@pytest.fixture
def access() -> Iterator[AccessLines]:
    logger = logging.getLogger("server.access")
    handler = AccessLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def one_line(access: AccessLines, request_id: str) -> dict[str, Any]:
    lines = access.wait_for(request_id)
    time.sleep(0.05)  # a second line would land now
    lines = access.wait_for(request_id)
    assert len(lines) == 1, f"one access line per request, got {lines}"
    return lines[0]


def test_request_id_is_echoed_and_logged_with_the_timings(client, access):
    r = client.post("/v1/segment", json={"image": b64_png(1), "box": BOX},
                    headers={"X-Request-ID": "abc-123"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-123"
    line = one_line(access, "abc-123")
    assert {k: line[k] for k in ("level", "logger", "message")} == {
        "level": "info",
        "logger": "server.access",
        "message": "request",
    }
    assert TS.fullmatch(line["ts"]), line["ts"]
    assert (line["method"], line["path"], line["route"], line["status"]) == (
        "POST",
        "/v1/segment",
        "/v1/segment",
        200,
    )
    timing = r.json()["timing_ms"]
    assert line["timing_ms"] == timing
    assert {"parse_and_decode", "encode", "decode", "mask_encode", "total"} <= set(timing)
    # the middleware's clock starts before the route's and stops after it
    assert isinstance(line["duration_ms"], float)
    assert line["duration_ms"] >= timing["total"] > 0


@pytest.mark.parametrize(
    ("path", "body", "phases"),
    [
        ("/v1/classify", {"top_k": 2}, {"classify", "total"}),
        ("/v1/embed", {}, {"encode"}),
    ],
)
def test_other_routes_log_their_timings(client, access, path, body, phases):
    r = client.post(path, json={"image": b64_png(2), **body}, headers={"X-Request-ID": path})
    assert r.status_code == 200, r.text
    line = one_line(access, path)
    assert (line["route"], line["status"]) == (path, 200)
    assert line["timing_ms"] == r.json()["timing_ms"]
    assert phases <= set(line["timing_ms"])


def test_an_id_is_generated_when_none_is_sent(client, access):
    ids = []
    for _ in range(2):
        r = client.get("/v1/models")
        assert r.status_code == 200
        ids.append(r.headers["x-request-id"])
    assert all(GENERATED_ID.fullmatch(i) for i in ids), ids
    assert ids[0] != ids[1]
    for request_id in ids:
        line = one_line(access, request_id)
        assert (line["route"], line["status"]) == ("/v1/models", 200)
        assert "timing_ms" not in line  # no model work, no timings
        assert line["duration_ms"] > 0


def test_refused_requests_are_logged_with_their_status(client, access):
    r = client.post("/v1/segment", json={"image": b64_png(3), "box": [1, 2, 3]},
                    headers={"X-Request-ID": "bad-box"})  # fmt: skip
    assert r.status_code == 422
    assert r.headers["x-request-id"] == "bad-box"
    line = one_line(access, "bad-box")
    assert (line["route"], line["status"]) == ("/v1/segment", 422)
    r = client.get("/no/such/path", headers={"X-Request-ID": "lost"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "lost"
    line = one_line(access, "lost")
    assert (line["path"], line["route"], line["status"]) == ("/no/such/path", "unmatched", 404)


def test_concurrent_requests_each_get_their_own_line(client, access):
    ids = [f"burst-{k}" for k in range(8)]

    def classify(request_id: str) -> httpx.Response:
        return client.post("/v1/classify", json={"image": b64_png(10 + int(request_id[-1]))},
                           headers={"X-Request-ID": request_id})  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        responses = list(pool.map(classify, ids))
    assert [r.headers["x-request-id"] for r in responses] == ids
    for request_id, r in zip(ids, responses, strict=True):
        assert r.status_code == 200, r.text
        assert one_line(access, request_id)["timing_ms"] == r.json()["timing_ms"]


def test_a_long_request_id_is_cut_and_odd_ones_stay_json(client, access):
    long_id = "x" * 500
    r = client.get("/v1/models", headers={"X-Request-ID": long_id})
    assert r.headers["x-request-id"] == long_id[:128]
    assert one_line(access, long_id[:128])["status"] == 200
    odd = 'a"b\\c{}'
    r = client.get("/v1/models", headers={"X-Request-ID": odd})
    assert r.headers["x-request-id"] == odd
    assert one_line(access, odd)["route"] == "/v1/models"  # escaped, parsed back intact


# -- the launcher's logging, for real ---------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`python -m server` with SERVE_LOG_LEVEL=INFO, its stdout and stderr in a file (a pipe
    nobody reads would fill up and block the server)."""
    port = free_port()
    path = tmp_path_factory.mktemp("logs") / "server.log"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_SWIN_MODEL": "swin_test", "SERVE_MAX_BATCH_SIZE": "2",
           "SERVE_BATCH_BUCKETS": "[1,2]", "SERVE_DECODER_MAX_BATCH_PROMPTS": "4",
           "SERVE_LOG_LEVEL": "INFO"}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with path.open("w") as log:
        proc = spawn_server(env, port, log)
        try:
            wait_until_ready(proc, url, path, 120)
            yield url, path
        finally:
            stop_server(proc, path)


def file_lines(path: Path, request_id: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        found = [e for e in entries if e.get("request_id") == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_python_dash_m_server_writes_one_json_object_per_line(launched):
    url, path = launched
    r = httpx.post(url + "/v1/segment", json={"image": b64_png(4), "box": BOX},
                   headers={"X-Request-ID": "abc-123"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-123"
    (line,) = file_lines(path, "abc-123")
    assert (line["logger"], line["route"], line["status"]) == ("server.access", "/v1/segment", 200)
    assert line["timing_ms"] == r.json()["timing_ms"] and line["duration_ms"] > 0
    generated = httpx.get(url + "/v1/models", timeout=30).headers["x-request-id"]
    assert GENERATED_ID.fullmatch(generated)
    assert file_lines(path, generated)[0]["route"] == "/v1/models"
    entries = [json.loads(line) for line in path.read_text().splitlines()]  # every line
    for entry in entries:
        assert {"ts", "level", "logger", "message"} <= set(entry), entry
        assert TS.fullmatch(entry["ts"]), entry
    loggers = {e["logger"] for e in entries}
    assert {
        "uvicorn.error",
        "server.engine.services",
        "server.access",
    } <= loggers  # all through one
    assert "uvicorn.access" not in loggers, "our access line replaces uvicorn's"
    assert any("RANDOM weights" in e["message"] for e in entries)
    # one access line per request: each readiness poll, the segment, the models call
    access = [e for e in entries if e["logger"] == "server.access"]
    assert len({e["request_id"] for e in access}) == len(access)


def test_no_terminal_colours_in_the_json(launched):
    _, path = launched
    assert "\\u001b[" not in path.read_text()


def test_probes_and_scrapes_log_at_debug_only(client, access):
    """A kubelet polling /readyz every few seconds would bury the start-up's lines at INFO."""
    logger = logging.getLogger("server.access")
    for path in ("/readyz", "/healthz", "/metrics"):
        assert client.get(path, headers={"X-Request-ID": f"info{path}"}).status_code == 200
    assert client.get("/v1/models", headers={"X-Request-ID": "work"}).status_code == 200
    assert one_line(access, "work")["level"] == "info"  # written after its response
    for path in ("/readyz", "/healthz", "/metrics"):
        assert access.wait_for(f"info{path}", timeout_s=0.2) == []
    access.setLevel(logging.DEBUG)
    logger.setLevel(logging.DEBUG)
    for path in ("/readyz", "/healthz", "/metrics"):
        client.get(path, headers={"X-Request-ID": f"debug{path}"})
        line = one_line(access, f"debug{path}")
        assert (line["level"], line["route"], line["status"]) == ("debug", path, 200)


def test_a_stop_that_hangs_fails_with_every_threads_stack(tmp_path: Path) -> None:
    """The tests' way out of a server that ignores SIGTERM: its stacks (`kill -USR1`,
    `server.logs.stacks_on_sigusr1`) in the failure, and the process killed."""
    path = tmp_path / "hung.log"
    script = (
        "import signal, threading, time\n"
        "from server.logs import stacks_on_sigusr1\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "stacks_on_sigusr1()\n"
        "def wait_forever():\n"
        "    time.sleep(300)\n"
        "threading.Thread(target=wait_forever, name='stuck', daemon=True).start()\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n"
    )
    with path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        while "up" not in path.read_text():
            assert proc.poll() is None, path.read_text()
            time.sleep(0.05)
        with pytest.raises(pytest.fail.Exception) as failed:
            stop_server(proc, path, timeout_s=1)
    assert proc.poll() is not None  # killed
    message = str(failed.value)
    assert "did not stop within 1 s" in message
    assert "in wait_forever" in message and "most recent call first" in message
