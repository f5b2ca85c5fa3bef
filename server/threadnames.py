"""Threads named for the operating system, so `top -H`, `ps -L`, py-spy and /proc show
which of the engine's threads burns the CPU (the decoder's worker, the event loop).

Python 3.11 names threads only for itself: every OS thread of a process is `python`.
Linux keeps a 15-byte name per thread, set by the thread itself (`prctl(PR_SET_NAME)`);
elsewhere naming is skipped, as nothing depends on it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from functools import cache

__all__ = ["name_this_thread", "os_thread_name"]

_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel's limit (TASK_COMM_LEN 16, with the terminating zero)


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process already has loaded (no search: `find_library` would run
    `ldconfig` in a subprocess, on the thread that asked)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)


def name_this_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name), cut to 15 bytes, as
    the OS sees it."""
    libc = _libc()
    if libc is None:
        return
    raw = (name or threading.current_thread().name).encode("ascii", "replace")
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw[:_NAME_BYTES]), 0, 0, 0)


def os_thread_name(pid: int, tid: int) -> str | None:
    """The OS name of thread `tid` of process `pid` (None once it has ended)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None
