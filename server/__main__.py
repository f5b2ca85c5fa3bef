"""`python -m server --host H --port P`: the launcher owns uvicorn, signals and the exit status.

`python -m server compile` builds what a start would (AOT packages with
SERVE_COMPILE_MODE=aot, inductor's caches otherwise) into SERVE_COMPILE_CACHE_DIR and exits,
for an init container or an image build step; starts with the same folder then load it.

SIGTERM (Kubernetes stopping the pod) drains before uvicorn stops listening: readiness
turns 503 at once and new requests get 503, while every request already accepted runs to
completion (bounded by `SERVE_DRAIN_TIMEOUT_S`; a body must arrive within the request
deadline, 408 otherwise); then uvicorn shuts down, giving what is still running
`SHUTDOWN_GRACE_S` more, and the process exits 0. A second SIGTERM, or SIGINT, stops at
once. From SIGTERM to exit: at most the drain timeout + `SHUTDOWN_GRACE_S` + the engine's
close (the batch running then finishes); k8s/ and docs/DEPLOYMENT.md hold that sum.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from server.engine.services import Engine
from server.http.app import build_app, drain
from server.http.state import ServeState, serve_state
from server.logs import configure_logging
from server.progress import StartupProgress
from server.settings import Settings
from server.settings_cli import BadSettingError, load_settings, settings_help

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

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        log.info("SIGTERM: draining (readiness off, new requests 503)")
        self.state.begin_drain()  # takes effect before the next request is read
        loop = asyncio.get_running_loop()  # signal handlers run on the loop's thread
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await drain(self.state)
        self.should_exit = True


async def compile_only(settings: Settings) -> int:
    """Load and warm every model as a start would (building what the cache lacks), then exit."""
    engine = Engine(settings)
    plan = engine.load_steps() + engine.warm_steps()
    progress = StartupProgress([label for label, _ in plan])
    try:
        await engine.load(progress)
        await engine.warmup(progress)
    finally:
        await engine.close()
    log.info("compiled into %s in %.1fs since process start",
             settings.compile_cache_dir, progress.elapsed())  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description=__doc__,
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "command", nargs="?", default="serve", choices=["serve", "compile"],
        help="serve (the default), or compile into SERVE_COMPILE_CACHE_DIR and exit",
    )  # fmt: skip
    args = parser.parse_args(argv)

    try:
        settings = load_settings()
    except BadSettingError as problem:
        parser.exit(2, f"python -m server: {problem}\n")  # one line, no traceback
    configure_logging(settings.log_level)
    if args.command == "compile":
        if settings.compile_cache_dir is None:
            parser.exit(2, "python -m server compile: needs SERVE_COMPILE_CACHE_DIR (a folder)\n")
        return asyncio.run(compile_only(settings))
    if settings.switch_interval_ms is not None:
        sys.setswitchinterval(settings.switch_interval_ms / 1000.0)
    app = build_app(settings)
    state = serve_state(app.state)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        workers=1,  # one process per GPU: the engine and its metrics live in this process
        log_config=None,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = DrainingServer(config, state)

    def stop() -> None:
        server.should_exit = True

    state.on_fatal = stop
    # After a second signal uvicorn restores the handler it found and raises the signal
    # again once it has shut down; with this no-op handler found, that ends in status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if state.failure is not None:
        log.error("exiting: %s", state.failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
