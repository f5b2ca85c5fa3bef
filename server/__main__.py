"""`python -m server --host H --port P`: the supervisor of the engine and the frontends.

`python -m server compile` builds what a start would (AOT packages with
SERVE_COMPILE_MODE=aot, inductor's caches otherwise) into SERVE_COMPILE_CACHE_DIR and exits,
for an init container or an image build step; starts with the same folder then load it.

The service is one engine process (models, batchers, caches; the GPU's) and
SERVE_HTTP_WORKERS frontend processes sharing the port (server/supervisor.py). SIGTERM
(Kubernetes stopping the pod) drains: readiness turns 503 at once and new requests get 503,
while every request already accepted runs to completion (bounded by
`SERVE_DRAIN_TIMEOUT_S`); then the frontends stop, giving what still runs
`SHUTDOWN_GRACE_S` more, then the engine, and the supervisor exits 0. A second SIGTERM,
or SIGINT, stops at once. From SIGTERM to exit: at most the drain timeout +
`SHUTDOWN_GRACE_S` + the engine's close (the batch running then finishes); k8s/ and
docs/DEPLOYMENT.md hold that sum. If the engine dies, the supervisor exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from server.http.worker import SHUTDOWN_GRACE_S
from server.logs import configure_logging, stacks_on_sigusr1
from server.progress import StartupProgress
from server.settings import Settings
from server.settings_cli import BadSettingError, load_settings, settings_help
from server.supervisor import serve

log = logging.getLogger("server")

__all__ = ["SHUTDOWN_GRACE_S", "main"]


async def compile_only(settings: Settings) -> int:
    """Load and warm every model as a start would (building what the cache lacks), then exit."""
    from server.engine.services import Engine  # torch: only this command needs it here

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
    configure_logging(settings.log_level, "supervisor")
    stacks_on_sigusr1()
    return serve(settings, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
