"""cProfile of every thread of one frontend process, grouped by the step each function
serves (`bench.frontend_cpu --profile`).

`ThreadProfiles.start` starts a profiler in the calling thread and, through
`threading.setprofile`, one in each thread started after it (the decode pool's threads,
where images are decoded and mask strings written). They count each thread's CPU time,
so a thread waiting (for work, for the GIL, in epoll) counts nothing. `steps` attributes
each function's own time (cProfile's `tottime`) to a step by the module it lives in, a
builtin to the step of its name (`_pickle.loads` is the engine call's pickling). A
deterministic profiler slows Python functions more than native ones, so the shares are a
map of where the time goes, not a measurement of it: `bench.frontend_cpu` measures the
totals without it.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from server.settings import Settings

# (step, substrings of "file:function"), first match wins
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics (prometheus_client)", ("prometheus_client", "server/metrics")),
    ("logging (access line)", ("logging/", "server/logs.py", "json/encoder", "json/__init__")),
    ("tracing", ("server/tracing", "opentelemetry", "trace_middleware")),
    ("middleware (ours)", ("server/http/middleware",)),
    ("multipart", ("server/http/multipart", "formparsers", "multipart/")),
    (
        "validation (pydantic, inputs)",
        ("pydantic", "server/http/inputs", "server/http/schemas", "model_validate", "model_dump"),
    ),
    ("image decode + sha256", ("server/imaging", "simplejpeg", "PIL/", "_hashlib", "sha256")),
    ("shm pixels", ("server/http/pixels",)),
    (
        "engine call (socket, pickle)",
        ("server/wire", "server/messages", "server/http/engine_client", "_pickle", "copyreg"),
    ),
    ("mask strings (RLE counts)", ("server/rle", "server/http/masks", "pycocotools", "_mask")),
    ("JSON response (orjson)", ("orjson", "server/http/responses")),
    ("routes", ("server/http/routes", "server/http/state", "server/domain", "dataclasses")),
    ("HTTP server (uvicorn, httptools)", ("uvicorn/", "httptools", "h11")),
    ("framework (starlette, fastapi)", ("starlette/", "fastapi/", "anyio/")),
    ("event loop, threads", ("asyncio/", "uvloop", "threading", "concurrent/", "queue.py")),
)
OTHER = "other"
# A pool thread's wait for work: still in progress when the stats are taken from another
# thread, which closes it with that thread's clock (seconds of "CPU" that never ran).
WAITS = ("<method 'get' of '_queue.SimpleQueue' objects>",)


def step_of(where: str) -> str:
    for step, needles in STEPS:
        if any(needle in where for needle in needles):
            return step
    return OTHER


class ThreadProfiles:
    """One `cProfile.Profile` per thread of the process, merged by `stats`."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _start_here(self, *_: Any) -> None:
        """The first profile event of a new thread: replace this hook by a profiler."""
        profile = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: waits are 0
        with self._lock:
            self.profiles.append(profile)
        profile.enable()

    def start(self) -> None:
        hook: Callable[[FrameType, str, Any], Any] = self._start_here
        threading.setprofile(hook)
        self._start_here()

    def stats(self) -> pstats.Stats:
        threading.setprofile(None)  # type: ignore[arg-type]
        with self._lock:
            profiles = list(self.profiles)
        for profile in profiles:
            profile.create_stats()
        merged = pstats.Stats(profiles[0])
        for profile in profiles[1:]:
            merged.add(profile)
        return merged


def steps(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per step, from merged stats."""
    totals: dict[str, float] = {}
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, tottime, _, _) in raw.items():
        if function in WAITS:
            continue
        step = step_of(f"{filename}:{function}")
        totals[step] = totals.get(step, 0.0) + tottime
    return totals


def top_functions(stats: pstats.Stats, n: int) -> list[tuple[str, float]]:
    """The `n` functions of most own time: ("file:line(function)", seconds)."""
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    kept = [item for item in raw.items() if item[0][2] not in WAITS]
    ranked = sorted(kept, key=lambda item: item[1][2], reverse=True)[:n]
    return [(f"{f}:{line}({fn})", row[2]) for (f, line, fn), row in ranked]


def run_frontend(
    settings: Settings,
    sock: socket.socket,
    addresses: tuple[str, ...],
    log_path: str,
    profile_path: str | None,
) -> None:
    """A frontend process of `bench.frontend_cpu` (here: no torch in it): `frontend_main`,
    its stderr (the JSON log) into `log_path`; with `profile_path`, cProfile in every
    thread from SIGUSR2 on, dumped at exit. (Not SIGUSR1: the frontend gives that to
    faulthandler's stack dumps, `server.logs.stacks_on_sigusr1`, which replaced this
    handler and left `bench.frontend_cpu --profile` waiting for the profile forever.)"""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    from server.http.worker import frontend_main

    profiles = ThreadProfiles()
    if profile_path is not None:
        marker = Path(profile_path + ".on")

        def start(signum: int, frame: object) -> None:
            profiles.start()
            marker.touch()

        signal.signal(signal.SIGUSR2, start)
    frontend_main(settings, sock, addresses, "frontend-0")
    if profile_path is not None and profiles.profiles:
        profiles.stats().dump_stats(profile_path)
