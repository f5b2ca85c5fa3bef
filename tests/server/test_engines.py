"""`python -m server` with two engine processes (SERVE_ENGINES=2) and two frontends, on the CPU.

Each engine holds its own embedding cache, so every call about an image must reach the
engine that embedded it: 50 images embedded and then clicked over new connections (so both
frontends route) get no 404, and each engine's cache holds exactly the images that hash to
it. Classify, which caches nothing, goes to both. Readiness waits for the slower engine,
an engine's death stops the service (exit 3), and SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from server.http.engine_client import rendezvous_hash
from tests.conftest import PHOTOS
from tests.server.conftest import free_port, spawn_server, stop_server, wait_until_ready
from tests.server.test_processes import ENV, fresh

IMAGES = 50


def crops(count: int) -> list[bytes]:
    """`count` different JPEGs: crops of the committed photos at shifting offsets."""
    photos = [Image.open(path).convert("RGB") for path in sorted(PHOTOS.glob("*.jpg"))]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        x, y = (7 * i) % (photo.width - 160), (5 * i) % (photo.height - 120)
        buffer = io.BytesIO()
        photo.crop((x, y, x + 160 + i, y + 120)).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


class Engines:
    """`python -m server` with SERVE_ENGINES=2 and two frontends; its log as text."""

    def __init__(self, tmp_path: Path, wait: bool = True, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.log = self.log_path.open("w+")
        full = {**os.environ, **ENV, "SERVE_HTTP_WORKERS": "2", "SERVE_ENGINES": "2", **env}
        self.proc = spawn_server(full, self.port, self.log)
        if wait:
            wait_until_ready(self.proc, self.url, self.log_path, 240)

    def pid_of(self, role: str, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in reversed(self.log_path.read_text().splitlines()):
                if f'"{role} process ' in line and ' started"' in line:
                    return int(line.split(f"{role} process ")[1].split()[0])
            time.sleep(0.05)
        raise AssertionError(f"no start of {role}:\n{self.log_path.read_text()}")

    def logged(self, role: str, text: str) -> bool:
        return any(
            f'"process": "{role}"' in line and text in line
            for line in self.log_path.read_text().splitlines()
        )

    def stop(self) -> int:
        """SIGTERM and the exit status (`stop_server`), or the status it already exited with."""
        try:
            code = self.proc.poll()
            return code if code is not None else stop_server(self.proc, self.log_path, 90)
        finally:
            self.log.close()


def engine_values(url: str, name: str, **labels: str) -> Counter[str]:
    """`name`'s samples summed per `engine` label (a sample name, e.g. `..._count`)."""
    with fresh(url) as c:
        text = c.get("/metrics").text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                counts[s.labels["engine"]] += s.value
    return counts


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    running = Engines(tmp_path_factory.mktemp("engines"))
    yield running
    assert running.stop() == 0, running.log_path.read_text()  # SIGTERM: a clean stop


def test_every_click_finds_its_image_on_the_engine_that_embedded_it(service):
    before = engine_values(service.url, "serve_embedding_cache_entries", tier="device")
    images = crops(IMAGES)
    ids, served = [], Counter()
    for data in images:
        with fresh(service.url) as c:
            r = c.post("/v1/embed", files={"image": ("crop.jpg", data, "image/jpeg")})
        assert r.status_code == 200, r.text
        ids.append(r.json()["image_id"])
        served[r.headers["x-served-by"]] += 1
    assert len(set(ids)) == IMAGES
    for image_id in ids:
        click = {"image_id": image_id, "point_coords": [[40, 30]], "point_labels": [1]}
        with fresh(service.url) as c:
            r = c.post("/v1/segment", json=click)
        assert r.status_code == 200, r.text  # never 404 unknown_image_id
        assert r.json()["image_id"] == image_id
        served[r.headers["x-served-by"]] += 1
    assert set(served) == {"frontend-0", "frontend-1"}, served  # both frontends routed
    # each engine embedded exactly the images whose home it is, and no other
    homes = Counter(str(rendezvous_hash(image_id, range(2))) for image_id in ids)
    after = engine_values(service.url, "serve_embedding_cache_entries", tier="device")
    assert {e: after[e] - before[e] for e in ("0", "1")} == {"0": homes["0"], "1": homes["1"]}
    assert min(homes.values()) >= 10  # both engines hold a share
    decoded = engine_values(service.url, "serve_batch_size_sum", stage="sam_decoder")
    assert decoded["0"] > 0 and decoded["1"] > 0


def test_classify_goes_to_both_engines(service):
    photo = (PHOTOS / "dog.jpg").read_bytes()
    before = engine_values(service.url, "serve_batch_size_sum", stage="swin")
    for _ in range(8):
        with fresh(service.url) as c:
            r = c.post("/v1/classify", files={"image": ("dog.jpg", photo, "image/jpeg")})
        assert r.status_code == 200, r.text
    after = engine_values(service.url, "serve_batch_size_sum", stage="swin")
    classified = {e: after[e] - before[e] for e in ("0", "1")}
    assert sum(classified.values()) == 8
    assert classified["0"] > 0 and classified["1"] > 0, classified


def test_metrics_show_every_engine(service):
    with fresh(service.url) as c:
        text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    roles = {s.labels["process"] for s in families["process_resident_memory_bytes"].samples}
    assert roles == {"engine-0", "engine-1", "frontend-0", "frontend-1"}
    depths = {
        (s.labels["engine"], s.labels["stage"]) for s in families["serve_queue_depth"].samples
    }
    assert {engine for engine, _ in depths} == {"0", "1"}
    assert [s.value for s in families["serve_ready"].samples] == [1.0]


def test_ready_waits_for_every_engine_and_an_engine_s_death_stops_the_service(tmp_path):
    service = Engines(tmp_path, wait=False, SERVE_FAULT_STEP_DELAY_S="0.3")
    try:
        slow = service.pid_of("engine-1")
        os.kill(slow, signal.SIGSTOP)  # engine-1 stays in its start-up
        deadline = time.monotonic() + 180
        while not service.logged("engine-0", "ready after"):
            assert service.proc.poll() is None, service.log_path.read_text()
            assert time.monotonic() < deadline, "engine-0 never got ready"
            time.sleep(0.1)
        for _ in range(10):  # engine-0 is warm, engine-1 is not: not ready
            r = httpx.get(service.url + "/readyz", timeout=5)
            assert r.status_code == 503, r.text
            time.sleep(0.1)
        os.kill(slow, signal.SIGCONT)
        wait_until_ready(service.proc, service.url, service.log_path, 180)
        assert service.logged("engine-1", "ready after")
        os.kill(slow, signal.SIGKILL)
        code = service.proc.wait(timeout=60)
    finally:
        with_code = service.stop()
    assert code == with_code == 3, service.log_path.read_text()
    assert service.logged("supervisor", "the engine process died (engine-1")
