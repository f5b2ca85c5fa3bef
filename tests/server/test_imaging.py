"""Image decoding: upright JPEGs take libjpeg-turbo's path into the engine's image memory
(simplejpeg, no GIL), and give the very pixels Pillow's path gives; everything else, and
anything that path refuses, still goes through Pillow with its errors."""

from __future__ import annotations

import io
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageOps

from models.sam.transforms import resize_longest_side_size
from models.swin.transforms import resize_shorter_side_size
from server import imaging
from server.errors import ServiceError
from server.http.pixels import SharedPixels
from tests.conftest import PHOTOS as TEST_PHOTOS

PHOTOS = sorted(TEST_PHOTOS.glob("*.jpg"))
ROOT = Path(__file__).resolve().parents[2]
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
    assert np.array_equal(decoded.pixels, pillow_pixels(data))


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
    assert np.array_equal(decoded.pixels, pillow_pixels(data))
    assert decoded.pixels.flags.c_contiguous and decoded.pixels.flags.writeable


def test_multi_picture_jpeg_gives_its_primary_image(fast_calls: list) -> None:
    """MPO (phones' portrait shots): the primary image comes first in the file."""
    buf = io.BytesIO()
    primary, depth = photo_like(120, 90), photo_like(60, 45, seed=1)
    primary.save(buf, format="MPO", save_all=True, append_images=[depth])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"
    decoded = imaging.decode_image(data, **LIMITS)
    assert fast_calls == [(90, 120, 3)]
    assert np.array_equal(decoded.pixels, pillow_pixels(data))


def test_rotated_cmyk_and_damaged_files_go_through_pillow(fast_calls: list) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to be upright
    rotated = encode(photo_like(80, 40), exif=exif.tobytes())
    decoded = imaging.decode_image(rotated, **LIMITS)
    assert (decoded.width, decoded.height) == (40, 80)
    assert np.array_equal(decoded.pixels, pillow_pixels(rotated))

    cmyk = encode(photo_like(64, 48, "CMYK"))
    assert np.array_equal(imaging.decode_image(cmyk, **LIMITS).pixels, pillow_pixels(cmyk))
    assert fast_calls == []  # neither reached simplejpeg

    whole = encode(photo_like(120, 90))
    truncated = whole[: len(whole) * 2 // 3]  # the header reads, the pixel data stops
    with pytest.raises(ServiceError) as caught:
        imaging.decode_image(truncated, **LIMITS)
    assert caught.value.status == 400 and "corrupt or truncated" in str(caught.value.message)


def test_pixels_land_in_the_given_memory(tmp_path) -> None:
    """The frontend's shared pixel file (page-locked by the engine on CUDA) is what the
    decoder writes into, a slot of it per image."""
    memory = SharedPixels(1 << 24, folder=tmp_path)
    try:
        decoded = imaging.decode_image(PHOTOS[0].read_bytes(), **LIMITS, memory=memory)
        assert memory.offset_of(decoded.pixels) == 0 and memory.slots == 1
        assert memory.held_bytes >= decoded.width * decoded.height * 3
        decoded.pixels[0, 0, 0] = 1  # the array is writable and its own
    finally:
        memory.close()


# -- scaled decoding: pixels at the size the model needs ------------------------------------


def drafted_pixels(data: bytes, scale: int) -> np.ndarray:
    """Pillow's own decode at 1/`scale` (libjpeg's DCT scaling), EXIF-upright, RGB."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    image.draft(None, (width // scale, height // scale))
    return np.asarray((ImageOps.exif_transpose(image) or image).convert("RGB"))


def test_decoding_needs_no_torch() -> None:
    """The frontend processes decode images and never import torch."""
    code = "import server.imaging, sys; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_resize_rules_match_the_models() -> None:
    rng = np.random.default_rng(0)
    for width, height in rng.integers(1, 6000, (2000, 2)).tolist():
        for target in (256, 1024):
            h, w = resize_longest_side_size(height, width, target)
            assert imaging._longest_side_size(width, height, target) == (w, h)
        h, w = resize_shorter_side_size(height, width, 248)
        assert imaging._shorter_side_size(width, height, 248) == (w, h)


@pytest.mark.parametrize("image_size", [256, 1024])
def test_sam_min_size_keeps_the_model_input(image_size: int) -> None:
    """Scaled only by 1/2, 1/4, 1/8, never below the input size, and always to pixels that
    resize to exactly the input the whole image resizes to."""
    rng = np.random.default_rng(image_size)
    scaled = 0
    for width, height in rng.integers(64, 6000, (3000, 2)).tolist():
        if max(width, height) > 64 * min(width, height):
            continue
        size = imaging.sam_min_size(width, height, image_size)
        if max(width, height) <= image_size:
            assert size is None
        if size is None:
            continue
        scaled += 1
        w, h = size
        assert any((w, h) == imaging._scaled(width, height, d) for d in (2, 4, 8))
        assert max(w, h) >= image_size
        assert resize_longest_side_size(h, w, image_size) == resize_longest_side_size(
            height, width, image_size
        )
    assert scaled > 1000  # most large images do scale


def test_swin_min_size_keeps_the_model_input() -> None:
    resize = 248  # swin_tiny: int(224 / 0.9)
    rng = np.random.default_rng(1)
    scaled = 0
    for width, height in rng.integers(64, 6000, (3000, 2)).tolist():
        size = imaging.swin_min_size(width, height, resize)
        if min(width, height) <= resize:
            assert size is None
        if size is None:
            continue
        scaled += 1
        w, h = size
        assert min(w, h) >= resize
        assert resize_shorter_side_size(h, w, resize) == resize_shorter_side_size(
            height, width, resize
        )
    assert scaled > 1000


@pytest.mark.parametrize("photo", PHOTOS, ids=lambda p: p.name)
def test_scaled_jpeg_keeps_the_image_size_and_pillows_pixels(photo: Path, fast_calls: list):
    """vit_tiny (256) takes the test photos of 512 pixels or more at 1/2 (groceries, 400
    wide, whole); the result still says the image's own size, and its pixels are Pillow's
    at that scale, byte for byte."""
    data = photo.read_bytes()
    whole = imaging.decode_image(data, **LIMITS)
    decoded = imaging.decode_image(
        data, **LIMITS, min_size=partial(imaging.sam_min_size, image_size=256)
    )
    assert (decoded.width, decoded.height) == (whole.width, whole.height)
    assert decoded.scaled == (max(whole.width, whole.height) >= 512)
    assert max(decoded.pixel_size) >= 256
    scale = -(-whole.width // decoded.pixel_size[0])
    assert decoded.pixel_size == imaging._scaled(whole.width, whole.height, scale)
    assert fast_calls[-1] == decoded.pixels.shape
    assert np.array_equal(decoded.pixels, drafted_pixels(data, scale))
    assert decoded.pixels.flags.c_contiguous and decoded.pixels.flags.writeable


def test_a_fixed_min_size_takes_the_smallest_scale_that_meets_it() -> None:
    data = encode(photo_like(800, 534))
    assert imaging.decode_image(data, **LIMITS, min_size=(300, 200)).pixel_size == (400, 267)
    assert imaging.decode_image(data, **LIMITS, min_size=(200, 100)).pixel_size == (200, 134)
    assert imaging.decode_image(data, **LIMITS, min_size=(1, 1)).pixel_size == (100, 67)
    whole = imaging.decode_image(data, **LIMITS, min_size=(401, 1))
    assert whole.pixel_size == (800, 534) and not whole.scaled


def test_small_images_and_other_formats_decode_whole(fast_calls: list) -> None:
    big = photo_like(2400, 1800)
    rule = partial(imaging.sam_min_size, image_size=1024)
    small = imaging.decode_image(encode(photo_like(1000, 700)), **LIMITS, min_size=rule)
    assert small.pixel_size == (1000, 700)  # already under 1024: never scaled
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    png = imaging.decode_image(buf.getvalue(), **LIMITS, min_size=rule)
    assert png.pixel_size == (2400, 1800) and not png.scaled
    jpeg = imaging.decode_image(encode(big), **LIMITS, min_size=rule)
    assert jpeg.pixel_size == (1200, 900) and (jpeg.width, jpeg.height) == (2400, 1800)


def test_rotated_and_cmyk_jpegs_scale_through_pillow(fast_calls: list) -> None:
    """Pillow's draft scales what simplejpeg does not take, in the stored frame; the
    rule is asked with the upright size and the result is upright."""
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 800 x 400, upright 400 x 800
    rotated = encode(photo_like(800, 400), exif=exif.tobytes())
    asked: list[tuple[int, int]] = []

    def rule(width: int, height: int) -> tuple[int, int] | None:
        asked.append((width, height))
        return imaging.sam_min_size(width, height, 256)

    decoded = imaging.decode_image(rotated, **LIMITS, min_size=rule)
    assert asked == [(400, 800)]
    assert (decoded.width, decoded.height) == (400, 800)
    assert decoded.pixel_size == (200, 400)
    assert np.array_equal(decoded.pixels, drafted_pixels(rotated, 2))

    cmyk = encode(photo_like(640, 480, "CMYK"))
    scaled = imaging.decode_image(cmyk, **LIMITS, min_size=(160, 120))
    assert scaled.pixel_size == (160, 120) and (scaled.width, scaled.height) == (640, 480)
    assert np.array_equal(scaled.pixels, drafted_pixels(cmyk, 4))
    assert fast_calls == []


def test_heap_pixels_own_a_writable_copy() -> None:
    source = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
    source.flags.writeable = False  # what np.asarray(PIL image) gives
    copy = imaging.heap_pixels.copy_in(source)
    assert copy.flags.writeable and copy.flags.c_contiguous and np.array_equal(copy, source)
    mine = np.zeros((2, 2, 3), dtype=np.uint8)
    assert imaging.heap_pixels.copy_in(mine) is mine  # made for it: no second copy
