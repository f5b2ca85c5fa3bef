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
from PIL import Image

STUBS = Path(__file__).resolve().parent / "_stubs"
# small real photos committed with the tests (their attribution: tests/photos/NOTICE)
PHOTOS = Path(__file__).resolve().parent / "photos"


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


@pytest.fixture(scope="session")
def small_photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three committed photos at most 200 px a side (two JPEGs, one PNG): real content
    that the tiny models run in about a second on the CPU."""
    sources = sorted(PHOTOS.glob("*.jpg"))
    assert len(sources) == 3, f"{PHOTOS} must hold the three test photos"
    folder = tmp_path_factory.mktemp("small-photos")
    for k, path in enumerate(sources):
        with Image.open(path) as image:
            small = image.convert("RGB")
            small.thumbnail((200, 200))
            small.save(folder / (f"{path.stem}.png" if k == 2 else path.name))
    return folder
