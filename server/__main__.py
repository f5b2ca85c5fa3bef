"""`python -m server --host H --port P`: the launcher owns uvicorn and the exit status."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from server.app import build_app
from server.logs import configure_logging
from server.settings import Settings
from server.state import serve_state

log = logging.getLogger("server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    settings = Settings()
    configure_logging(settings.log_level)
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
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
    )
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    state.on_fatal = stop
    # uvicorn drains on SIGTERM, restores the handler it found, then raises the signal
    # again; with this no-op handler found, a clean drain ends in exit status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if state.failure is not None:
        log.error("exiting: %s", state.failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
