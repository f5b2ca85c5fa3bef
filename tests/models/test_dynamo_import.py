"""The engine imports torch._dynamo on a thread of its own while it loads weights; anything
that compiles must wait for that import, or two threads enter torch._dynamo's and
torch._inductor's import cycle from opposite ends (an engine failed to start on the H100
with "cannot import name 'IndentedBuffer' from partially initialized module")."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import models.dynamo_import as dynamo_import
from models.optimize import compile_fn


def test_compile_fn_waits_for_the_background_import(monkeypatch: pytest.MonkeyPatch) -> None:
    finished = threading.Event()

    def slow_import() -> None:
        time.sleep(0.3)
        finished.set()

    thread = threading.Thread(target=slow_import, name="preimport")
    monkeypatch.setattr(dynamo_import, "_PREIMPORT", thread)
    thread.start()
    compiled = compile_fn(lambda x: x + 1, "default", dynamic=False)
    assert finished.is_set()  # compile_fn returned only after the import had ended
    assert compiled is not None


def test_no_background_import_once_dynamo_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo  # noqa: F401  (already imported in the test process)

    monkeypatch.setattr(dynamo_import, "_PREIMPORT", None)
    dynamo_import.preimport_dynamo()
    assert dynamo_import._PREIMPORT is None  # nothing to overlap: no thread
    dynamo_import.preimported()  # returns at once


FRESH = """
import sys, torch
import models.dynamo_import as dynamo_import
from models.optimize import compile_fn
assert "torch._dynamo" not in sys.modules
dynamo_import.preimport_dynamo()
assert dynamo_import._PREIMPORT is not None and dynamo_import._PREIMPORT.is_alive()
f = compile_fn(lambda x: x * 2, "default", dynamic=False)  # at once, on this thread
assert not dynamo_import._PREIMPORT.is_alive()
print("ok")
"""


def test_a_fresh_process_compiles_while_the_import_runs() -> None:
    """The engine's order in a process where torch._dynamo is not loaded yet."""
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
