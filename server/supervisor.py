"""`python -m server`: one engine process and N frontend processes, and their fate.

The supervisor listens on the port itself and hands the socket to every frontend (the
kernel spreads connections over them), starts the engine (models, batchers, caches: the
GPU's one process), and then only watches:
- the engine exits: the service cannot serve; the frontends are stopped and the
  supervisor exits non-zero (1 for a failed start-up, 3 for a later death), so the pod
  restarts. A service that silently lost its models would be worse.
- a frontend exits: another takes its place (its requests in flight are lost; the others'
  are not). Five deaths within a few seconds of their start: something is wrong with every
  frontend, and the supervisor gives up (exit 4).
- SIGTERM: every frontend drains (readiness 503, accepted requests finish; see
  `server.http.worker`), then the engine stops, then the supervisor exits 0. A second
  SIGTERM, or SIGINT, stops everything at once.

Spawned, not forked: the engine initialises CUDA, which does not survive a fork, and
nothing here has imported torch.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from server.http.pixels import PIXELS_PREFIX, SHM_FOLDER
from server.metrics_multiprocess import forget_process
from server.settings import Settings

log = logging.getLogger("server.supervisor")

RESTART_WINDOW_S = 10.0  # a frontend dying this soon after its start counts as a crash loop
MAX_QUICK_DEATHS = 5
EXIT_START_FAILED = 1
EXIT_ENGINE_DIED = 3
EXIT_FRONTENDS_FAIL = 4


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every frontend accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, settings: Settings, host: str, port: int) -> None:
        self.settings = settings
        self.sock = listen(host, port)
        shm = Path("/dev/shm")
        self.folder = Path(tempfile.mkdtemp(prefix="serve-", dir=shm if shm.is_dir() else None))
        self.metrics_folder = self.folder / "metrics"
        self.metrics_folder.mkdir()
        # read by prometheus_client in every child at import: one /metrics for all
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_folder)
        self.address = f"ipc://{self.folder}/engine.sock"
        self.context = multiprocessing.get_context("spawn")
        self.engine: BaseProcess | None = None
        self.frontends: dict[int, tuple[BaseProcess, float]] = {}
        self.quick_deaths = 0
        self.stopping = False  # SIGTERM: drain, then stop

    # -- processes --------------------------------------------------------------------

    def _start_engine(self) -> None:
        from server.engine.process import engine_main

        self.engine = self.context.Process(
            target=engine_main, args=(self.settings, self.address), name="engine"
        )
        self.engine.start()
        log.info("engine process %d started", self.engine.pid)

    def _start_frontend(self, index: int) -> None:
        from server.http.worker import frontend_main

        role = f"frontend-{index}"
        process = self.context.Process(
            target=frontend_main, args=(self.settings, self.sock, self.address, role), name=role
        )
        process.start()
        self.frontends[index] = (process, time.monotonic())
        log.info("%s process %d started", role, process.pid)

    # -- signals ------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not self.stopping:
            log.info("SIGTERM: draining every frontend, then stopping the engine")
            self.stopping = True
            self._signal_frontends(signal.SIGTERM)
            return
        log.info("%s: stopping at once", signal.Signals(signum).name)
        self.stopping = True
        self._signal_frontends(signal.SIGTERM)  # their second: they stop at once
        self._signal_frontends(signal.SIGTERM)
        if self.engine is not None and self.engine.is_alive():
            self.engine.terminate()

    def _signal_frontends(self, signum: int) -> None:
        for process, _ in self.frontends.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    # -- the watch ------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start_engine()
            for index in range(self.settings.frontends()):
                self._start_frontend(index)
            return self._watch()
        finally:
            self._stop_all()
            self.sock.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _watch(self) -> int:
        assert self.engine is not None
        while True:
            sentinels = [self.engine.sentinel] + [p.sentinel for p, _ in self.frontends.values()]
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            if not self.engine.is_alive():
                code = self.engine.exitcode
                if self.stopping:
                    return 0
                if code == EXIT_START_FAILED:
                    log.error("the engine failed to start (exit 1): stopping the service")
                    return EXIT_START_FAILED
                log.error("the engine process died (exit %s): stopping the service", code)
                return EXIT_ENGINE_DIED
            for index, (process, started) in list(self.frontends.items()):
                if process.is_alive():
                    continue
                del self.frontends[index]
                self._forget(process)
                if self.stopping:
                    continue
                quick = time.monotonic() - started < RESTART_WINDOW_S
                self.quick_deaths = self.quick_deaths + 1 if quick else 0
                log.warning("frontend-%d (pid %s) exited with %s; starting another",
                            index, process.pid, process.exitcode)  # fmt: skip
                if self.quick_deaths >= MAX_QUICK_DEATHS:
                    log.error("frontends keep dying at start: stopping the service")
                    return EXIT_FRONTENDS_FAIL
                self._start_frontend(index)
            if self.stopping and not self.frontends:
                log.info("every frontend drained; stopping the engine")
                self.engine.terminate()  # SIGTERM: the engine finishes its calls in hand
                self.engine.join(timeout=self.settings.drain_timeout_s + 30)
                return 0

    def _forget(self, process: BaseProcess) -> None:
        """A dead process's live gauges leave /metrics (its counters stay), and a dead
        frontend's pixel file goes (the engine unmaps it once it sees the file gone)."""
        if process.pid is None:
            return
        forget_process(self.metrics_folder, process.pid)
        for folder in (SHM_FOLDER, Path(tempfile.gettempdir())):
            for leftover in folder.glob(f"{PIXELS_PREFIX}-pixels-{process.pid}-*"):
                leftover.unlink(missing_ok=True)

    def _stop_all(self) -> None:
        """Whatever still runs when the supervisor leaves (an error, an engine death):
        a second SIGTERM stops a frontend without its drain."""
        self._signal_frontends(signal.SIGTERM)
        time.sleep(0.05)
        self._signal_frontends(signal.SIGTERM)
        engine = self.engine
        if engine is not None and engine.is_alive():
            engine.terminate()
        deadline = time.monotonic() + 10
        for process in [p for p, _ in self.frontends.values()] + ([engine] if engine else []):
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def serve(settings: Settings, host: str, port: int) -> int:
    """Run the service until it is stopped; the process's exit status."""
    return Supervisor(settings, host, port).run()
