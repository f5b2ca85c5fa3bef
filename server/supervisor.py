"""`python -m server`: engine processes (one per GPU) and N frontend processes, and their fate.

The supervisor listens on the port itself and hands the socket to every frontend (the
kernel spreads connections over them), starts the engines (models, batchers, caches: one
process per GPU, each seeing only its own, `server.gpus`; each frontend connects to all of
them and routes by image, `server.http.engine_client`), and then only watches:
- an engine exits: the service cannot serve (a share of the images lived there); the
  others and the frontends are stopped and the supervisor exits non-zero (1 for a failed
  start-up, 3 for a later death), so the pod restarts. A service that silently lost its
  models would be worse.
- a frontend exits: another takes its place (its requests in flight are lost; the others'
  are not). Five deaths within a few seconds of their start: something is wrong with every
  frontend, and the supervisor gives up (exit 4).
- SIGTERM: every frontend drains (readiness 503, accepted requests finish; see
  `server.http.worker`), then every engine stops, then the supervisor exits 0. A second
  SIGTERM, or SIGINT, stops everything at once. The stop is bounded: a frontend still
  running `FRONTEND_EXIT_S` after its drain's timeout, or an engine `ENGINE_EXIT_S` after
  the frontends are gone (a batch that never returns), writes its threads' stacks to the
  log (SIGUSR1), is killed, and an error line names it; the supervisor still exits 0, as
  it was asked to stop and did, within the sum docs/DEPLOYMENT.md gives Kubernetes.

Spawned, not forked: an engine initialises CUDA, which does not survive a fork, and
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
from collections import Counter
from collections.abc import Iterator, Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from server.engine.entry import run_engine
from server.gpus import EnginePlan, plan_engines
from server.http.pixels import PIXELS_PREFIX, SHM_FOLDER
from server.metrics_multiprocess import forget_process
from server.mps import MpsError, MpsServer, start_mps
from server.settings import Settings, available_cores

log = logging.getLogger("server.supervisor")

RESTART_WINDOW_S = 10.0  # a frontend dying this soon after its start counts as a crash loop
# after the drain's timeout: uvicorn's grace for what still runs (SHUTDOWN_GRACE_S, 5 s) and
# the process's own exit
FRONTEND_EXIT_S = 7.0
ENGINE_EXIT_S = 5.0  # the engine's close once no frontend is left: its batch in hand ends
STACKS_WAIT_S = 1.0  # between SIGUSR1 (stacks to the log) and SIGKILL
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
        self.plans = plan_engines(settings, os.environ)
        self.addresses = tuple(f"ipc://{self.folder}/{p.role}.sock" for p in self.plans)
        self.context = multiprocessing.get_context("spawn")
        self.engines: list[BaseProcess] = []
        self.mps: MpsServer | None = None
        self.frontends: dict[int, tuple[BaseProcess, float]] = {}
        self.quick_deaths = 0
        self.stopping = False  # SIGTERM: drain, then stop
        self.stop_started: float | None = None  # monotonic time of the first SIGTERM
        self._signals: list[int] = []  # received, not yet acted on (`_on_signal`)
        # a signal writes a byte to the second (`signal.set_wakeup_fd`, in `run`), which
        # wakes the watch loop's wait on the first at once
        self._wakeup, self._wake = socket.socketpair()
        for end in (self._wakeup, self._wake):
            end.setblocking(False)

    def _plan_time_sliced(self, why: str) -> None:
        """`auto` counted on an MPS server of our own: without one, engines on a GPU take
        turns on it; with one set up outside (a device plugin's MPS sharing), this pod may
        hold only a share of the GPU and its memory. Either way, plan again with the
        time-sliced count, before any process starts (so frontends get the addresses of
        the engines that run)."""
        plans = plan_engines(self.settings, os.environ, shared=False)
        if len(plans) != len(self.plans):
            log.info("%s: %d engines instead of %d", why, len(plans), len(self.plans))
            self.plans = plans
            self.addresses = tuple(f"ipc://{self.folder}/{p.role}.sock" for p in plans)

    def _settle_plan(self) -> None:
        """The engines to start, now that whether they share their GPU is known."""
        if self.mps is None:
            self._plan_time_sliced("no MPS")
        elif not self.mps.owned:
            self._plan_time_sliced("an MPS server set up outside (a share of the GPU?)")
        self._log_plan()

    def _log_plan(self) -> None:
        """One line that says how many engines each GPU gets and why, for an operator who
        sees six engines where they expected two."""
        per_gpu = Counter(p.env.get("CUDA_VISIBLE_DEVICES") for p in self.plans)
        if None in per_gpu:
            return  # the CPU: nothing pinned
        how = "under MPS" if self.mps is not None else "time-sliced"
        if max(per_gpu.values()) == 1:
            how = "one a GPU"
        if self.settings.engines == "auto" and self.settings.engines_per_gpu == "auto":
            how += f", SERVE_ENGINES_PER_GPU=auto with {available_cores()} cores"
        layout = ", ".join(f"{n} on GPU {gpu}" for gpu, n in per_gpu.items())
        log.info("engines: %s (%s)", layout, how)

    # -- processes --------------------------------------------------------------------

    def _start_engine(self, plan: EnginePlan, address: str) -> None:
        engine = self.context.Process(
            target=run_engine, args=(self.settings, address, plan.role), name=plan.role
        )
        env = {**plan.env, **(self.mps.env if self.mps else {})}
        if env:
            log.info("%s gets %s", plan.role, " ".join(f"{k}={v}" for k, v in env.items()))
        with _environment(env):  # a spawned child starts with our environment
            engine.start()
        self.engines.append(engine)
        log.info("%s process %d started", plan.role, engine.pid)

    def _start_frontend(self, index: int) -> None:
        from server.http.worker import frontend_main

        role = f"frontend-{index}"
        process = self.context.Process(
            target=frontend_main, args=(self.settings, self.sock, self.addresses, role), name=role
        )
        process.start()
        self.frontends[index] = (process, time.monotonic())
        log.info("%s process %d started", role, process.pid)

    # -- signals ------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Note it; `_watch`, woken by the signal's byte, acts on it. Nothing more here: a
        handler runs between any two bytecodes of the main thread, and a log line (its
        stream's buffer) or a lock taken here may be the one the interrupted code holds,
        which hung a frontend on SIGTERM (`server.http.state.ServeState.refuse_new_work`)."""
        self._signals.append(signum)

    def _act_on_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGTERM and not self.stopping:
                log.info("SIGTERM: draining every frontend, then stopping the engines")
                self.stopping = True
                self.stop_started = time.monotonic()
                self._signal_frontends(signal.SIGTERM)
                continue
            log.info("%s: stopping at once", signal.Signals(signum).name)
            self.stopping = True
            self.stop_started = self.stop_started or time.monotonic()
            self._signal_frontends(signal.SIGTERM)  # their second: they stop at once
            self._signal_frontends(signal.SIGTERM)
            self._terminate_engines()

    def _terminate_engines(self) -> None:
        """SIGTERM: each engine finishes the calls in hand, then exits."""
        for engine in self.engines:
            if engine.is_alive():
                engine.terminate()

    def _signal_frontends(self, signum: int) -> None:
        for process, _ in self.frontends.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    # -- the watch ------------------------------------------------------------------------

    def run(self) -> int:
        previous_fd = signal.set_wakeup_fd(self._wake.fileno())
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            try:
                self.mps = start_mps(self.settings.mps, self.plans, os.environ, self.folder)
            except MpsError as error:
                log.error("SERVE_MPS=on: %s", error)
                return EXIT_START_FAILED
            self._settle_plan()
            for plan, address in zip(self.plans, self.addresses, strict=True):
                self._start_engine(plan, address)
            for index in range(self.settings.frontends()):
                self._start_frontend(index)
            return self._watch()
        finally:
            self._stop_all()
            if self.mps is not None:
                self.mps.stop()
            self.sock.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            signal.set_wakeup_fd(previous_fd)
            self._wake.close()
            self._wakeup.close()

    def _watch(self) -> int:
        while True:
            sentinels: list[Any] = [e.sentinel for e in self.engines]
            sentinels += [p.sentinel for p, _ in self.frontends.values()]
            multiprocessing.connection.wait([*sentinels, self._wakeup], timeout=0.5)
            with contextlib.suppress(BlockingIOError):
                self._wakeup.recv(4096)  # the signals' bytes: `_signals` holds them
            self._act_on_signals()
            for engine in self.engines:
                if engine.is_alive():
                    continue
                code = engine.exitcode
                if self.stopping:
                    return 0
                if code == EXIT_START_FAILED:
                    log.error("%s failed to start (exit 1): stopping the service", engine.name)
                    return EXIT_START_FAILED
                log.error("the engine process died (%s, exit %s): stopping the service",
                          engine.name, code)  # fmt: skip
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
            if self.stopping and self.frontends and self._frontends_overdue():
                self._force_stop([p for p, _ in self.frontends.values()], "its drain")
            if self.stopping and not self.frontends:
                log.info("every frontend drained; stopping the engines")
                self._terminate_engines()
                deadline = time.monotonic() + ENGINE_EXIT_S
                for engine in self.engines:
                    engine.join(timeout=max(0.1, deadline - time.monotonic()))
                self._force_stop(self.engines, "the frontends' drain")
                return 0

    def _frontends_overdue(self) -> bool:
        if self.stop_started is None:
            return False
        allowed = self.settings.drain_timeout_s + FRONTEND_EXIT_S
        return time.monotonic() - self.stop_started > allowed

    def _force_stop(self, processes: list[BaseProcess], after: str) -> None:
        """Kill what has not stopped in its time, its threads' stacks written to the log
        first (`server.logs.stacks_on_sigusr1`): a stop that hangs is bounded and says
        where it hung."""
        stuck = [(p, p.pid) for p in processes if p.is_alive() and p.pid is not None]
        if not stuck:
            return
        for process, pid in stuck:
            log.error(
                "%s (pid %d) did not stop in time after %s: its threads' stacks follow in "
                "the log; killing it", process.name, pid, after,
            )  # fmt: skip
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(STACKS_WAIT_S)
        for process, _ in stuck:
            process.kill()
            process.join(timeout=5)

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
        self._terminate_engines()
        deadline = time.monotonic() + 10
        remaining = [p for p, _ in self.frontends.values()] + self.engines
        for process in remaining:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
        self._force_stop(remaining, "the supervisor's exit")


@contextlib.contextmanager
def _environment(changes: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `changes` for the duration (the supervisor has one thread)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def serve(settings: Settings, host: str, port: int) -> int:
    """Run the service until it is stopped; the process's exit status."""
    return Supervisor(settings, host, port).run()
