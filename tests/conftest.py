"""Test-wide set-up: Meta's `segment_anything` imports torchvision, which has no CPU build
matching our torch; where no real torchvision imports, the test-only stand-in in
tests/_stubs goes on `sys.path` first (see tests/_stubs/README.md)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

STUBS = Path(__file__).resolve().parent / "_stubs"


def pytest_configure(config: pytest.Config) -> None:
    try:
        importlib.import_module("torchvision")
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, str(STUBS))


@pytest.fixture
def recompile_probe() -> Iterator[Callable[[], bool]]:
    """Call it: whether a never-seen shape made dynamo compile again, which tells the
    process's compile stance by behaviour (default: recompiles; `eager_on_recompile`:
    runs eagerly). Dynamo and the stance are reset around the test."""
    torch._dynamo.reset()
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    add_one = torch.compile(lambda x: x + 1, backend=counting, dynamic=False)
    add_one(torch.zeros(1))
    sizes = iter(range(2, 1000))

    def recompiles() -> bool:
        before = len(graphs)
        add_one(torch.zeros(next(sizes)))
        return len(graphs) > before

    yield recompiles
    torch.compiler.set_stance("default")
    torch._dynamo.reset()
