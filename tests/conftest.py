"""Test-wide set-up: Meta's `segment_anything` imports torchvision, which has no CPU build
matching our torch; where no real torchvision imports, the test-only stand-in in
tests/_stubs goes on `sys.path` first (see tests/_stubs/README.md)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

STUBS = Path(__file__).resolve().parent / "_stubs"


def pytest_configure(config: pytest.Config) -> None:
    try:
        importlib.import_module("torchvision")
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, str(STUBS))
