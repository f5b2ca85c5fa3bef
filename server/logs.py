"""Structured JSON logs: one object per line, with the request id when there is one."""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import time
from typing import Any

# uvicorn adds `color_message` (the same text with terminal colour escapes) to its records.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """Log records as JSON, carrying any `extra={...}` fields as top-level keys, and the
    process they came from (`supervisor`, `engine`, `frontend-0`, ...): every process of
    the service writes to the same stream."""

    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.role is not None:
            entry["process"] = self.role
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, role: str | None = None) -> None:
    """Route every logger (uvicorn's too) through one JSON handler on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Our access line replaces uvicorn's, which lacks the request id and timings.
    logging.getLogger("uvicorn.access").disabled = True


def stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (the log).

    For a process that hangs, where its own logging cannot run (a blocked event loop, a
    stop that never finishes); each of the service's processes installs it (supervisor,
    engines, frontends), and the tests send it before they give up on a stop.
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)
