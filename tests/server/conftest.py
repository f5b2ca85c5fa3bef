"""A real uvicorn server on a free loopback port, serving small models on the CPU."""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import uvicorn
from PIL import Image

from server.http.app import build_app
from server.settings import Settings
from tests.conftest import PHOTOS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


ROOT = Path(__file__).resolve().parents[2]


def spawn_server(env: dict[str, str], port: int, log: object) -> subprocess.Popen:
    """`python -m server` on 127.0.0.1:port as users start it, its output into `log` (a
    file: a pipe nobody reads would fill up and block the server)."""
    return subprocess.Popen(
        [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def service_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The supervisor `proc` and the service's processes it started (engines, frontends),
    not multiprocessing's resource tracker (which a SIGUSR1 would end)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        return [p for p in family if "resource_tracker" not in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return []


def stop_server(proc: subprocess.Popen, log_path: Path, timeout_s: float = 60) -> int:
    """SIGTERM `python -m server` and its exit status once it has drained and stopped.

    A stop that takes longer fails the test with the log, after every process of the
    service has written its threads' stacks to it (SIGUSR1, `server.logs`), and nothing is
    left running.
    """
    proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    alive = service_processes(proc)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGUSR1)
    time.sleep(2)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in p.children(recursive=True):  # the resource tracker too
                child.kill()
            p.kill()
    proc.wait(timeout=30)
    names = ", ".join(f"{p.pid}" for p in alive)
    pytest.fail(
        f"python -m server did not stop within {timeout_s:.0f} s of SIGTERM (still running: "
        f"{names}); its log, with every thread's stack at the end:\n{log_path.read_text()[-20000:]}"
    )


def wait_until_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Poll /readyz until 200; fail with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"python -m server was not ready in {timeout_s:.0f} s"
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def small_settings(**overrides: object) -> Settings:
    """Tiny models on the CPU: the same code paths as production, in milliseconds."""
    values: dict[str, object] = {
        "device": "cpu",
        "sam_model": "vit_tiny",
        "swin_model": "swin_test",
        "max_batch_size": 4,
        "classify_max_batch_size": 4,
        "batch_buckets": [1, 2, 4],
        "max_queue_delay_ms": 5.0,
        "decoder_max_batch_prompts": 32,
        "decode_threads": 2,
        "max_body_bytes": 4 * 1024 * 1024,
        "max_image_pixels": 8_000_000,
        "log_level": "WARNING",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


class LiveServer:
    """uvicorn in a thread; `url` answers once /readyz is 200 (or `wait_ready=False`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = build_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_config=None, lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True, timeout_s: float = 120.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not answer {path} in {timeout_s}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    server = LiveServer(small_settings()).start()
    yield server
    server.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., LiveServer]]:
    """Servers with other settings, stopped at the end of the test."""
    started: list[LiveServer] = []

    def make(wait_ready: bool = True, **overrides: object) -> LiveServer:
        server = LiveServer(small_settings(**overrides)).start(wait_ready=wait_ready)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def encode(image: Image.Image, fmt: str = "JPEG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth, photo-like RGB picture (gradients and a disc), so JPEG keeps it stable."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    cx, cy = width * rng.uniform(0.3, 0.7), height * rng.uniform(0.3, 0.7)
    disc = ((xx - cx) ** 2 + (yy - cy) ** 2) < (min(width, height) / 4) ** 2
    rgb = np.stack(
        [xx / max(width, 1) * 255, yy / max(height, 1) * 255, np.full_like(xx, 90)], axis=-1
    )
    rgb[disc] = (230, 40, 40)
    return Image.fromarray(rgb.astype(np.uint8))


@pytest.fixture(scope="session")
def jpeg_bytes() -> bytes:
    return encode(photo_like(320, 240), "JPEG", quality=92)


@pytest.fixture(scope="session")
def png_bytes() -> bytes:
    return encode(photo_like(200, 300, seed=1), "PNG")


@pytest.fixture(scope="session")
def real_photo() -> bytes:
    """A real photograph, committed with the tests."""
    return (PHOTOS / "dog.jpg").read_bytes()
