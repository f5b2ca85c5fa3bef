"""The load tools run against the same real servers as tests/server (tiny models, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import PHOTOS
from tests.server.conftest import live_server, make_server

__all__ = ["live_server", "make_server", "small_jpeg_dir"]


@pytest.fixture(scope="session")
def small_jpeg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed photos as JPEGs of at most 200 px a side: the tiny models segment them
    in tens of milliseconds, so a few requests a second stay below saturation on 2 cores."""
    folder = tmp_path_factory.mktemp("openloop-photos")
    for path in sorted(PHOTOS.glob("*.jpg")):
        with Image.open(path) as image:
            small = image.convert("RGB")
            small.thumbnail((200, 200))
            small.save(folder / path.name, quality=90)
    return folder
