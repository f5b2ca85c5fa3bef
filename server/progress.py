"""Start-up progress: what the server is doing before it is ready, for the log and /readyz.

A cold start takes seconds on a CPU and minutes when it compiles on a GPU. Before this,
the log fell silent for up to 175 s at a time and /readyz said only "loading or warming
up". Now every step logs one line as it begins, with "n of m" and the seconds since the
process started, so a silence in the log is explained by the line above it; /readyz
answers with the same while warming.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("server.startup")


def process_started() -> float:
    """The wall-clock time this process started (Linux `/proc`), else now.

    Seconds "since process start" then include the interpreter's and torch's imports,
    which is what a user waiting for `python -m server` to be ready counts.
    """
    try:
        # field 22 (starttime, clock ticks after boot); the name in () may hold spaces
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (up - started_after_boot)


@dataclass
class StartupProgress:
    """The planned steps of a start-up and which one runs now."""

    steps: list[str]
    started: float = field(default_factory=process_started)
    current: int = 0  # 1-based index of the step running; 0 before the first

    def begin(self, step: str) -> None:
        """Mark `step` (one of `steps`, in order) as running and log its line."""
        self.current = self.steps.index(step, self.current) + 1
        log.info(
            "start-up %d of %d: %s (%.1fs since process start)",
            self.current, len(self.steps), step, self.elapsed(),
            extra={"step": self.current, "steps": len(self.steps)},
        )  # fmt: skip

    def elapsed(self) -> float:
        return time.time() - self.started

    def snapshot(self) -> dict[str, Any]:
        """What /readyz shows while warming."""
        doing = self.steps[self.current - 1] if self.current else "starting"
        return {
            "step": self.current,
            "of": len(self.steps),
            "doing": doing,
            "seconds": round(self.elapsed(), 1),
        }
