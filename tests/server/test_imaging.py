"""Image decoding: upright JPEGs take libjpeg-turbo's path into the engine's image memory
(simplejpeg, no GIL), and give the very pixels Pillow's path gives; everything else, and
anything that path refuses, still goes through Pillow with its errors."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageOps

from models.images import PinnedPixels
from server.errors import ServiceError
from server.http import imaging
from tests.conftest import PHOTOS as TEST_PHOTOS

PHOTOS = sorted(TEST_PHOTOS.glob("*.jpg"))
LIMITS = {"max_pixels": 40_000_000, "max_bytes": 50 << 20}


def pillow_pixels(data: bytes) -> np.ndarray:
    """What the service decoded before the fast path: Pillow, EXIF-upright, RGB."""
    image = Image.open(io.BytesIO(data))
    return np.asarray((ImageOps.exif_transpose(image) or image).convert("RGB"))


def encode(image: Image.Image, **options: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", **options)
    return buf.getvalue()


def photo_like(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[:height, :width]
    base = np.stack([xs * 255 // max(width, 1), ys * 255 // max(height, 1), (xs ^ ys) & 255], -1)
    noisy = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(noisy, "RGB").convert(mode)


@pytest.fixture
def fast_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Shapes decoded by simplejpeg (the real one, observed, not replaced)."""
    calls: list[tuple[int, ...]] = []
    real = simplejpeg.decode_jpeg

    def observed(*args: object, **kwargs: object) -> np.ndarray:
        out = real(*args, **kwargs)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(imaging.simplejpeg, "decode_jpeg", observed)
    return calls


@pytest.mark.parametrize("photo", PHOTOS, ids=lambda p: p.name)
def test_photos_take_the_fast_path_and_match_pillow(photo: Path, fast_calls: list) -> None:
    data = photo.read_bytes()
    decoded = imaging.decode_image(data, **LIMITS)
    assert fast_calls == [(decoded.height, decoded.width, 3)]
    assert np.array_equal(decoded.pixels.numpy(), pillow_pixels(data))


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("RGB", {"quality": 90, "subsampling": 0}),  # 4:4:4
        ("RGB", {"quality": 75, "subsampling": 2}),  # 4:2:0
        ("RGB", {"progressive": True}),
        ("L", {}),  # grayscale: replicated to three channels, as Pillow's convert("RGB")
    ],
)
def test_jpeg_kinds_match_pillow(mode: str, options: dict, fast_calls: list) -> None:
    data = encode(photo_like(173, 91, mode), **options)  # odd sizes: partial MCUs
    decoded = imaging.decode_image(data, **LIMITS)
    assert fast_calls == [(91, 173, 3)]
    assert np.array_equal(decoded.pixels.numpy(), pillow_pixels(data))
    assert decoded.pixels.is_contiguous()


def test_multi_picture_jpeg_gives_its_primary_image(fast_calls: list) -> None:
    """MPO (phones' portrait shots): the primary image comes first in the file."""
    buf = io.BytesIO()
    primary, depth = photo_like(120, 90), photo_like(60, 45, seed=1)
    primary.save(buf, format="MPO", save_all=True, append_images=[depth])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"
    decoded = imaging.decode_image(data, **LIMITS)
    assert fast_calls == [(90, 120, 3)]
    assert np.array_equal(decoded.pixels.numpy(), pillow_pixels(data))


def test_rotated_cmyk_and_damaged_files_go_through_pillow(fast_calls: list) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to be upright
    rotated = encode(photo_like(80, 40), exif=exif.tobytes())
    decoded = imaging.decode_image(rotated, **LIMITS)
    assert (decoded.width, decoded.height) == (40, 80)
    assert np.array_equal(decoded.pixels.numpy(), pillow_pixels(rotated))

    cmyk = encode(photo_like(64, 48, "CMYK"))
    assert np.array_equal(imaging.decode_image(cmyk, **LIMITS).pixels.numpy(), pillow_pixels(cmyk))
    assert fast_calls == []  # neither reached simplejpeg

    whole = encode(photo_like(120, 90))
    truncated = whole[: len(whole) * 2 // 3]  # the header reads, the pixel data stops
    with pytest.raises(ServiceError) as caught:
        imaging.decode_image(truncated, **LIMITS)
    assert caught.value.status == 400 and "corrupt or truncated" in str(caught.value.message)


def test_pixels_land_in_the_given_memory() -> None:
    """The engine's image memory (pinned on CUDA) is what the decoder writes into."""
    memory = PinnedPixels(1 << 30, pin_memory=False)
    decoded = imaging.decode_image(PHOTOS[0].read_bytes(), **LIMITS, memory=memory)
    assert memory.held_bytes == decoded.width * decoded.height * 3
    decoded.pixels[0, 0, 0] = 1  # the tensor is writable and its own
