"""`python -m server` as deployed: a supervisor, one engine process, several frontends.

Every test starts the real thing (small models on the CPU) and talks to it over HTTP: the
one embedding cache seen from every frontend, the fate of the service when the engine or a
frontend dies, and one /metrics for every process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import PHOTOS
from tests.server.conftest import ROOT, free_port, spawn_server, stop_server, wait_until_ready

ENV = {
    "SERVE_DEVICE": "cpu",
    "SERVE_SAM_MODEL": "vit_tiny",
    "SERVE_SWIN_MODEL": "swin_test",
    "SERVE_MAX_BATCH_SIZE": "2",
    "SERVE_BATCH_BUCKETS": "[1,2]",
    "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
    "SERVE_LOG_LEVEL": "INFO",
}


class Service:
    """`python -m server` with `workers` frontends; its log read as JSON lines."""

    def __init__(self, tmp_path: Path, workers: int, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.log = self.log_path.open("w+")
        full = {**os.environ, **ENV, "SERVE_HTTP_WORKERS": str(workers), **env}
        self.proc = spawn_server(full, self.port, self.log)
        wait_until_ready(self.proc, self.url, self.log_path, 240)

    def lines(self) -> list[dict[str, object]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def pid_of(self, role: str) -> int:
        """The pid the supervisor logged for `role` (`engine-0`, `frontend-0`), latest first."""
        for entry in reversed(self.lines()):
            message = str(entry.get("message", ""))
            if message.startswith(f"{role} process ") and message.endswith(" started"):
                return int(message.split()[2])
        raise AssertionError(f"no start of {role} in the log:\n{self.log_path.read_text()}")

    def stop(self) -> int:
        """SIGTERM and the exit status (`stop_server`), or the status it already exited with."""
        try:
            code = self.proc.poll()
            return code if code is not None else stop_server(self.proc, self.log_path, 90)
        finally:
            self.log.close()


def fresh(url: str) -> httpx.Client:
    """A client on a new connection: the kernel hands each one to some frontend."""
    return httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    running = Service(tmp_path_factory.mktemp("processes"), workers=2)
    yield running
    assert running.stop() == 0, running.log_path.read_text()


def test_a_click_through_one_frontend_finds_the_image_sent_through_another(service):
    photo = (PHOTOS / "dog.jpg").read_bytes()
    with fresh(service.url) as c:
        sent = c.post("/v1/embed", files={"image": ("dog.jpg", photo, "image/jpeg")})
    assert sent.status_code == 200, sent.text
    first = sent.headers["x-served-by"]
    image_id = sent.json()["image_id"]
    click = {"image_id": image_id, "point_coords": [[200, 150]], "point_labels": [1]}
    seen = {first}
    for _ in range(60):  # new connections until another frontend takes one
        with fresh(service.url) as c:
            r = c.post("/v1/segment", json=click)
        assert r.status_code == 200, r.text  # every frontend finds the one cache
        assert r.json()["image_id"] == image_id
        seen.add(r.headers["x-served-by"])
        if len(seen) > 1:
            break
    assert seen == {"frontend-0", "frontend-1"}, seen


def test_an_idle_connection_outlives_a_proxys_idle_pool(service):
    """A proxy reuses its idle connection to a pod for up to 60 s (ingress-nginx): the
    service must not close it first (uvicorn's own default, 5 s, did: a POST on it got the
    proxy's 502). One connection, a request, 6 s idle, a request on the same socket."""
    photo = (PHOTOS / "dog.jpg").read_bytes()
    keep = httpx.Limits(keepalive_expiry=60)  # the client's own default drops it after 5 s
    with httpx.Client(base_url=service.url, timeout=60, limits=keep) as c:
        first = c.post("/v1/classify", files={"image": ("dog.jpg", photo, "image/jpeg")})
        assert first.status_code == 200, first.text
        time.sleep(6)
        events: list[str] = []
        second = c.post("/v1/classify", files={"image": ("dog.jpg", photo, "image/jpeg")},
                        extensions={"trace": lambda name, info: events.append(name)})  # fmt: skip
    assert second.status_code == 200, second.text
    assert "connection.connect_tcp.started" not in events, "the idle connection was closed"


def test_only_the_engine_process_loads_torch(service):
    """The supervisor once imported torch to name the engine's entry point: seconds of
    every start before the engine existed. Only the engine may map libtorch."""

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    assert maps_torch(service.pid_of("engine-0"))
    assert not maps_torch(service.proc.pid)
    assert not maps_torch(service.pid_of("frontend-0"))


def test_every_frontend_answers_for_every_process_in_metrics(service):
    photo = {"image": ("dog.jpg", (PHOTOS / "dog.jpg").read_bytes(), "image/jpeg")}
    with fresh(service.url) as c:
        assert c.post("/v1/classify", files=photo).status_code == 200
    answers = {}
    for _ in range(60):
        with fresh(service.url) as c:
            r = c.get("/metrics")
        assert r.status_code == 200
        answers[r.headers["x-served-by"]] = r.text
        if len(answers) == 2:
            break
    assert set(answers) == {"frontend-0", "frontend-1"}
    for text in answers.values():
        families = {f.name: f for f in text_string_to_metric_families(text)}
        roles = {s.labels["process"] for s in families["process_resident_memory_bytes"].samples}
        assert roles == {"engine-0", "frontend-0", "frontend-1"}, roles
        # the engine's stage metrics reach every frontend's answer
        batches = [s for s in families["serve_batch_size"].samples if s.name.endswith("_count")]
        assert any(s.labels["stage"] == "swin" and s.value >= 1 for s in batches), batches
        ready = [s.value for s in families["serve_ready"].samples]
        assert ready == [1.0], ready


def test_a_killed_frontend_is_replaced_and_the_service_goes_on(tmp_path):
    service = Service(tmp_path, workers=2)
    try:
        victim = service.pid_of("frontend-1")
        pixel_files = f"serve-pixels-{victim}-*"
        assert list(Path("/dev/shm").glob(pixel_files)), "the frontend's pixel file"
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while service.pid_of("frontend-1") == victim:
            assert time.monotonic() < deadline, "no frontend took the dead one's place"
            time.sleep(0.2)
        served = set()
        while served != {"frontend-0", "frontend-1"}:  # the new one joins the port
            assert time.monotonic() < deadline, f"only {served} answered"
            with fresh(service.url) as c:
                r = c.get("/readyz")
            assert r.status_code == 200, r.text  # the other frontend served meanwhile
            served.add(r.headers["x-served-by"])
            time.sleep(0.05)
        assert not list(Path("/dev/shm").glob(pixel_files)), "the dead one's file is removed"
    finally:
        assert service.stop() == 0, service.log_path.read_text()


def test_kill_9_of_the_engine_stops_the_service_non_zero(tmp_path):
    service = Service(tmp_path, workers=2)
    os.kill(service.pid_of("engine-0"), signal.SIGKILL)
    try:
        code = service.proc.wait(timeout=60)
    finally:
        service.stop()
    assert code not in (0, None), service.log_path.read_text()
    log = service.log_path.read_text()
    assert "the engine process died" in log
    for role in ("frontend-0", "frontend-1"):  # nothing left behind
        status = Path(f"/proc/{service.pid_of(role)}/status")
        assert not status.exists() or "zombie" in status.read_text().lower()


def test_a_batch_that_never_returns_does_not_keep_the_service_from_stopping(tmp_path):
    """SIGTERM while a classify batch hangs: the frontend drains (its request ends at its
    deadline), the engine cannot finish its batch, so after its time the supervisor has it
    write its stacks to the log and kills it; the stop is bounded and says where it hung."""
    service = Service(
        tmp_path, workers=1, SERVE_ENABLE_SAM="false", SERVE_WARMUP="false",
        SERVE_FAULT_HANG_STAGE="swin", SERVE_FAULT_HANG_S="300",
        SERVE_DRAIN_TIMEOUT_S="2", SERVE_REQUEST_TIMEOUT_S="2",
    )  # fmt: skip
    photo = (PHOTOS / "dog.jpg").read_bytes()
    with fresh(service.url) as c:
        r = c.post("/v1/classify", files={"image": ("dog.jpg", photo, "image/jpeg")})
    assert r.status_code == 504, r.text  # the hung batch runs on in the engine
    started = time.monotonic()
    code = service.stop()
    took = time.monotonic() - started
    log = service.log_path.read_text()
    assert code == 0, log
    # drain (2 s, nothing in flight: at once), the engine's 5 s, 1 s for its stacks
    assert took < 2 + 7 + 5 + 1 + 5, (took, log)
    assert "engine-0 (pid" in log and "did not stop in time" in log
    assert "in faulty" in log  # the engine's stack: the hung batch function
    assert "frontend-0 (pid" not in log  # the frontend stopped by itself


def test_a_frontend_never_imports_torch():
    """HTTP, decoding and mask strings need no torch: eight frontends would otherwise each
    hold its few hundred MB and its import time."""
    code = (
        "import sys, server.http.worker, server.supervisor, server.__main__; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
