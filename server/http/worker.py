"""A frontend process: uvicorn serving `build_app` on the socket the supervisor listens on.

SIGTERM drains before uvicorn stops listening: readiness turns 503 at once and new requests
get 503, while every request already accepted runs to completion (bounded by
`SERVE_DRAIN_TIMEOUT_S`; a body must arrive within the request deadline, 408 otherwise);
then uvicorn shuts down, giving what is still running `SHUTDOWN_GRACE_S` more, and the
process exits 0. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import signal
import socket
from types import FrameType

import uvicorn

from server import tracing
from server.http.app import build_app, drain
from server.http.state import ServeState, serve_state
from server.logs import configure_logging, stacks_on_sigusr1
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("server")

# uvicorn's graceful shutdown, after the drain has already waited for accepted requests:
# what still runs then gets this long before it is cancelled. Not the drain timeout again,
# which once doubled the wait past Kubernetes' grace period (SIGKILL).
SHUTDOWN_GRACE_S = 5


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM drains the service before the server stops."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state
        self._drain: asyncio.Task[None] | None = None
        self._drain_asked = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain_asked or self.should_exit:
            super().handle_exit(sig, frame)  # uvicorn's: flags only
            return
        self._drain_asked = True
        # Only what is safe between any two bytecodes: no log line, no metric (their locks
        # may be held by the code this interrupted); the rest runs on the loop, next.
        self.state.refuse_new_work()  # takes effect before the next request is read
        loop = asyncio.get_running_loop()  # signal handlers run on the loop's thread
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        log.info("SIGTERM: draining (readiness off, new requests 503)")
        self.state.begin_drain()
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await drain(self.state)
        self.should_exit = True


# glibc's mallopt parameters (malloc.h) and the values a frontend sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what a request frees for the next one: True when set.

    An upload's buffers (the body, the image part, libjpeg's working memory in a decode
    thread) are 0.1 to 10 MB, allocated and freed per request. By default glibc maps the
    largest afresh each time and gives the threads' arenas back to the kernel once free
    (`madvise`), so the next request faults in and zeroes new pages: 1.2 to 1.5 ms of
    system time per segment or classify upload on the 2-core CPU, against 0.2 to 0.4 ms
    with these thresholds (`python -m bench.frontend_cpu`, docs/BENCHMARKS.md). The cost
    is memory kept: up to `TRIM_THRESHOLD_BYTES` free per arena before any is returned.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator as it is
        return False
    if mallopt is None:
        return False
    trimmed = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(trimmed and mapped)


def frontend_main(
    settings: Settings, sock: socket.socket, engine_addresses: tuple[str, ...], role: str
) -> None:
    """A frontend process's entry point (spawned by the supervisor); it talks to every
    engine (`server.http.engine_client` picks one per call)."""
    configure_logging(settings.log_level, role)
    stacks_on_sigusr1()
    if not keep_freed_memory():
        log.info("malloc thresholds not set (not glibc): uploads fault in fresh pages")
    tracing.setup(role)  # before build_app, which adds the tracing middleware when on
    app = build_app(settings, Metrics(role), engine_address=engine_addresses, role=role)
    state = serve_state(app.state)
    config = uvicorn.Config(
        app, log_config=None, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, backlog=2048,
        timeout_keep_alive=settings.keep_alive_s,
    )  # fmt: skip
    server = DrainingServer(config, state)
    # After a second signal uvicorn restores the handler it found and raises the signal
    # again once it has shut down; with this no-op handler found, that ends in status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        tracing.shutdown()  # export what is batched before the process ends
