"""torch._dynamo imported in the background while the engine starts, and the wait for it.

The import takes 7 s on the H100 machine (issue 21). Beside the device's start and the
weights' loading, which spend their time in C++ with the GIL released, it costs little. But
torch._dynamo and torch._inductor import each other: a `torch.compile` or `torch.export` on
another thread meanwhile enters the same cycle from the other end, and Python's import lock
hands one of them a half-initialised module (`ImportError: cannot import name
'IndentedBuffer' from partially initialized module 'torch._inductor.utils'`: an engine that
failed to start on the H100, 2026-11-24). So whatever compiles or exports calls
`preimported()` first (`models.optimize.compile_fn`, `models.aot.AotStore`).

A module of its own, light to import: the AOT warm start imports it without the
optimisation code.
"""

from __future__ import annotations

import importlib
import sys
import threading

__all__ = ["preimport_dynamo", "preimported"]

_PREIMPORT: threading.Thread | None = None


def preimport_dynamo() -> None:
    """Start importing torch._dynamo on a thread of its own, unless it is loaded already."""
    global _PREIMPORT
    if _PREIMPORT is None and "torch._dynamo" not in sys.modules:
        _PREIMPORT = threading.Thread(
            target=importlib.import_module, args=("torch._dynamo",), name="preimport", daemon=True
        )
        _PREIMPORT.start()


def preimported() -> None:
    """Wait until `preimport_dynamo`'s import, if one was started, has finished."""
    if _PREIMPORT is not None:
        _PREIMPORT.join()
