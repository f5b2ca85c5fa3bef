"""Faults found when the service was attacked as a user would (issue 17, the HTTP side).

Each against a real server, over raw sockets where a client misbehaves mid-body: hostile
multipart part headers (the event loop stays free, 400 with a clear message), a client
that leaves mid-upload (a 499, logged at info, not a 500), a body that stalls (408 within
the request deadline, at shutdown too), and what error messages and logs may echo.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from server.http.multipart import MAX_PART_HEADER_BYTES
from server.http.schemas import is_image_id
from tests.server.conftest import (
    LiveServer,
    encode,
    free_port,
    photo_like,
    small_settings,
    spawn_server,
    wait_until_ready,
)
from tests.server.test_api_errors import assert_error
from tests.server.test_api_service import metric_samples
from tests.server.test_hostile_inputs import png_with_padding

MiB = 1024 * 1024
BOUNDARY = "hostileboundary"
JPEG = encode(photo_like(160, 120, seed=11), "JPEG", quality=90)


def multipart(disposition: bytes, data: bytes) -> bytes:
    """One file part named by `disposition` (the rest of its Content-Disposition line)."""
    head = b"Content-Disposition: form-data; " + disposition + b"\r\nContent-Type: image/jpeg"
    return b"".join(
        [b"--", BOUNDARY.encode(), b"\r\n", head, b"\r\n\r\n", data, b"\r\n--",
         BOUNDARY.encode(), b"--\r\n"]
    )  # fmt: skip


def post_multipart(url: str, body: bytes, timeout: float = 60) -> httpx.Response:
    """To /v1/embed, which needs nothing but the image."""
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    return httpx.post(url + "/v1/embed", content=body, headers=headers, timeout=timeout)


def metric(url: str, name: str, **labels: str) -> float:
    samples = metric_samples(httpx.get(url + "/metrics", timeout=10).text)
    return sum(s.value for s in samples.get(name, []) if labels.items() <= s.labels.items())


def raw_upload(port: int, declared: int, sent: bytes, path: str = "/v1/segment") -> socket.socket:
    """A POST that declares `declared` body bytes and sends only `sent`, then waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {declared}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response on `sock` (read until it closes or
    the declared length is in)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def roomy() -> Iterator[LiveServer]:
    """A server whose body limit lets the issue's 9 and 16 MB bodies in."""
    server = LiveServer(small_settings(max_body_bytes=20 * MiB)).start()
    yield server
    server.stop()


# -- 3. multipart part headers ---------------------------------------------------------


class ProbeTimer:
    """Polls /healthz on its own thread while something else runs; keeps the slowest."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.count = 0
        self.failures: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                started = time.perf_counter()
                status = c.get("/healthz").status_code
                if status != 200:
                    self.failures.append(status)
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.count += 1
                time.sleep(0.01)

    def __enter__(self) -> ProbeTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self.failures, f"/healthz answered {self.failures}"


# /healthz takes 10-40 ms while these bodies are handled; the bound leaves room for a
# loaded CI machine (2 cores, load 7-9: one 0.57 s outlier seen), far below the 2.4-6.5 s
# the hostile bodies once froze the loop for.
PROBE_BOUND_S = 1.0

HOSTILE_HEADERS = {
    # the two bodies: a 9 MB filename of escapes, a 16 MB unclosed quoted parameter
    "escapes": b'name="image"; filename="' + b"\\a" * (4 * MiB + MiB // 2) + b'"',
    "unclosed quote": b'name="image"; filename="' + b"a" * (16 * MiB),
}


@pytest.mark.parametrize("case", HOSTILE_HEADERS, ids=list(HOSTILE_HEADERS))
def test_hostile_part_headers_leave_the_loop_free(roomy: LiveServer, case: str) -> None:
    body = multipart(HOSTILE_HEADERS[case], JPEG)
    with ProbeTimer(roomy.url) as probes:
        time.sleep(0.1)
        r = post_multipart(roomy.url, body)
        time.sleep(0.1)
    assert probes.count >= 3
    # once 2.4-3.9 s: the parameter regex and re.sub on the event loop
    assert probes.slowest < PROBE_BOUND_S, f"/healthz took {probes.slowest:.3f} s"
    assert_error(r, 400, "invalid_multipart")
    assert f"{MAX_PART_HEADER_BYTES} bytes" in r.json()["error"]["message"]
    assert len(r.content) < 1000  # the header is not echoed


def test_part_headers_are_capped_not_refused(roomy: LiveServer) -> None:
    """A long but plausible file name passes; past the cap, a 400 that says so."""
    ok = multipart(b'name="image"; filename="' + "\u00e9".encode() * 600 + b'.jpg"', JPEG)
    assert post_multipart(roomy.url, ok).status_code == 200
    long = multipart(b'name="image"; filename="' + b"x" * MAX_PART_HEADER_BYTES + b'.jpg"', JPEG)
    r = post_multipart(roomy.url, long)
    assert_error(r, 400, "invalid_multipart")
    assert "headers run past" in r.json()["error"]["message"]


# the second one (an RFC 5987 name beside the plain one) only Starlette's parser reads
@pytest.mark.parametrize("extra", [b"", b"; filename*=utf-8''big.png"], ids=["ours", "starlette"])
def test_large_bodies_are_parsed_off_the_loop(roomy: LiveServer, extra: bytes) -> None:
    """A 12 MB upload, read by either reader in the thread pool: it is served, and
    /healthz stays quick meanwhile."""
    image = png_with_padding(photo_like(160, 120, seed=5), 12 * MiB)
    body = multipart(b'name="image"; filename="big.png"' + extra, image)
    with ProbeTimer(roomy.url) as probes:
        r = post_multipart(roomy.url, body)
    assert r.status_code == 200, r.text
    assert r.json()["width"] == 160
    assert probes.slowest < PROBE_BOUND_S, f"/healthz took {probes.slowest:.3f} s"


# -- 5. a client leaving mid-upload ----------------------------------------------------


def test_client_leaving_mid_upload_is_a_499(
    roomy: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = roomy.url
    before = {
        "499": metric(url, "serve_requests_total", route="/v1/segment", status="499"),
        "500": metric(url, "serve_requests_total", route="/v1/segment", status="500"),
        "internal": metric(url, "serve_rejections_total", reason="internal"),
        "cancelled": metric(url, "serve_rejections_total", reason="cancelled"),
    }
    sock = raw_upload(roomy.port, 2 * MiB, b"x" * 200_000)
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 10
    while metric(url, "serve_requests_total", route="/v1/segment", status="499") == before["499"]:
        assert time.monotonic() < deadline, "the departure was never counted as a 499"
        time.sleep(0.05)
    assert metric(url, "serve_rejections_total", reason="cancelled") == before["cancelled"] + 1
    assert metric(url, "serve_rejections_total", reason="internal") == before["internal"]
    assert metric(url, "serve_requests_total", route="/v1/segment", status="500") == before["500"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("disconnected" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)  # fmt: skip


# -- 6. a body that stalls ---------------------------------------------------------------


def test_stalled_uploads_get_408_within_the_deadline(make_server) -> None:
    server = make_server(request_timeout_s=1.5)
    started = time.monotonic()
    socks = [raw_upload(server.port, 3 * MiB, b"x" * 300_000) for _ in range(4)]
    try:
        assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
        for sock in socks:
            status, headers, body = read_response(sock)
            assert status == 408
            assert json.loads(body)["error"]["code"] == "body_timeout"
            assert headers.get("connection") == "close"
            assert sock.recv(1) == b"", "the connection is closed after the 408"
    finally:
        for sock in socks:
            sock.close()
    assert time.monotonic() - started < 1.5 + 2.0  # once held for as long as they stalled
    assert metric(server.url, "serve_requests_total", route="/v1/segment", status="408") == 4
    # a whole body sent slowly, but within the deadline, is served
    body = multipart(b'name="image"; filename="a.jpg"', JPEG)
    sock = raw_upload(server.port, len(body), b"", path="/v1/embed")
    try:
        for k in range(0, len(body), 1000):
            sock.sendall(body[k : k + 1000])
            time.sleep(0.01)
        status, _, answer = read_response(sock)
        assert status == 200, answer
    finally:
        sock.close()


def test_sigterm_with_a_stalled_upload_exits_within_the_drain(tmp_path) -> None:
    """The issue's case: one stalled upload made SIGTERM take the drain plus uvicorn's
    graceful period (66.5 s), and its client got a plain-text 500."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_ENABLE_SWIN": "false", "SERVE_MAX_BATCH_SIZE": "2",
           "SERVE_BATCH_BUCKETS": "[1,2]", "SERVE_DECODER_MAX_BATCH_PROMPTS": "4",
           "SERVE_REQUEST_TIMEOUT_S": "3", "SERVE_DRAIN_TIMEOUT_S": "8",
           "SERVE_LOG_LEVEL": "INFO"}  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = spawn_server(env, port, log)
    try:
        wait_until_ready(proc, url, tmp_path / "server.log", 240)
        sock = raw_upload(port, 3 * MiB, b"x" * 300_000)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status, _, body = read_response(sock)
        sock.close()
        assert status == 408, body
        assert json.loads(body)["error"]["code"] == "body_timeout"
        assert proc.wait(timeout=60) == 0
        # answered at its deadline (3 s), so the drain ends then: before the drain timeout
        # (8 s), let alone uvicorn's graceful period on top of it (once 8 + 13 s)
        assert time.monotonic() - sent < 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "server.log").read_text()
    assert "drained: no request in flight" in out, out
    assert '"level": "error"' not in out, out


# -- 8. hygiene ------------------------------------------------------------------------


def test_a_failed_batch_says_what_failed_not_where(make_server, png_bytes) -> None:
    """The injected fault is a real torch error, whose text names torch internals."""
    server = make_server(fault_raise_stage="swin")
    r = httpx.post(server.url + "/v1/classify", timeout=60,
                   files={"image": ("a.png", png_bytes, "image/png")})  # fmt: skip
    assert_error(r, 500, "internal")
    message = r.json()["error"]["message"]
    assert message == "the swin batch failed (RuntimeError)"


def test_echoed_input_is_cut(roomy: LiveServer) -> None:
    key = "k" * (2 * MiB)
    r = httpx.post(roomy.url + "/v1/segment", timeout=60,
                   json={"image_id": "0" * 64, key: 1})  # fmt: skip
    assert_error(r, 422, "invalid_request")
    assert len(r.content) < 1000, len(r.content)  # once the whole key: a 2 MB 422
    assert f"({len(key)} characters)" in r.json()["error"]["message"]
    r = httpx.post(roomy.url + "/v1/segment", content=b"{}", timeout=30,
                   headers={"content-type": "text/" + "x" * 20_000})  # fmt: skip
    assert_error(r, 415, "unsupported_media_type")
    assert len(r.content) < 1000, len(r.content)


def test_image_id_with_a_trailing_newline_is_refused(roomy: LiveServer) -> None:
    good = "a" * 64
    assert is_image_id(good)
    assert not is_image_id(good + "\n")
    r = httpx.get(roomy.url + "/v1/embeddings/" + good + "%0A", timeout=30)
    assert_error(r, 422, "invalid_request")


def test_logged_paths_are_cut(make_server, caplog: pytest.LogCaptureFixture) -> None:
    server = make_server(api_key="secret")
    caplog.set_level(logging.INFO, logger="server.access")
    path = "/v1/" + "p" * 60_000
    r = httpx.get(server.url + path, timeout=30)
    assert_error(r, 401, "unauthorized")
    logged: list[str] = []
    deadline = time.monotonic() + 10  # the line is written once the answer has been sent
    while not logged:
        assert time.monotonic() < deadline, "the request was never logged"
        time.sleep(0.05)
        lines = [rec for rec in caplog.records if rec.name == "server.access"]
        logged = [rec.path for rec in lines if rec.path.startswith("/v1/ppp")]  # type: ignore[attr-defined]
    assert all(len(p) < 400 for p in logged), [len(p) for p in logged]
    assert "(60004 characters)" in logged[0]
