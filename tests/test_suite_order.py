"""The suite's own scheduling (tests/conftest.py): the modules it runs first exist, so a
renamed one is not silently left to the end again."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SLOW_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_run_first_exists() -> None:
    missing = [m for m in SLOW_MODULES if not (ROOT / m).is_file()]
    assert not missing, f"SLOW_MODULES names modules that are gone: {missing}"
    assert len(set(SLOW_MODULES)) == len(SLOW_MODULES)
