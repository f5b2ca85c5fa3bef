"""Image bytes -> validated `uint8 [H, W, 3]` numpy pixels (runs in the decode thread pool).

Everything a client can send wrong about an image is caught here, with the status the
contract gives it: unreadable, truncated or corrupt bytes are 400; images whose header
declares more pixels than allowed are 413 *before* any pixel is decoded (decompression
bombs); the EXIF orientation is applied, and every colour mode the formats carry
(grayscale, palette, alpha, CMYK, 16-bit) becomes 8-bit RGB, so the models see one form.

Pillow's own bomb guard (`Image.MAX_IMAGE_PIXELS`, a process-wide warning) is not our
policy: `max_pixels` is. Its warning is silenced while a header is read, and its hard
error (past twice its limit) is one more 413.

A JPEG can be decoded at 1/2, 1/4 or 1/8 of its size by libjpeg-turbo's DCT scaling, far
cheaper than decoding it whole, when the model would shrink it anyway (`min_size`;
`sam_min_size` and `swin_min_size` choose it so that the model's input keeps its exact
size). The pixels are then smaller than the image, whose own size the result still
reports: responses and masks are in the image's pixels. No torch here: the frontend
processes never import it.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from server.errors import ServiceError

__all__ = [
    "DecodedImage",
    "HeapPixels",
    "MinSize",
    "PixelMemory",
    "decode_base64_image",
    "decode_image",
    "heap_pixels",
    "sam_min_size",
    "sha256_hex",
    "swin_min_size",
]

# Formats a camera, a browser or an annotation tool produces. MPO is what many phones
# write for JPEG (a JPEG with extra frames); its first frame is the photo.
ACCEPTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "TIFF", "GIF"})
# Only these decoders are tried: the others (EPS, PSD, ICO, ...) never see client bytes.
_OPEN_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF")
# A side ratio past this would make resize-shortest-side (Swin) explode in size, and
# resize-longest-side (SAM) round the short side to zero pixels.
MAX_ASPECT_RATIO = 64


class PixelMemory(Protocol):
    """Where decoded pixels are written: plain memory, or memory the engine reads directly
    (shared, page-locked). Both give uint8, C-contiguous, writable arrays."""

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """A buffer to decode into."""
        ...

    def copy_in(self, pixels: np.ndarray) -> np.ndarray:
        """A copy (or the array itself, when it is already such a buffer of this memory)."""
        ...


class HeapPixels:
    """Ordinary numpy memory: the default, and all a process without an engine needs."""

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, dtype=np.uint8)

    def copy_in(self, pixels: np.ndarray) -> np.ndarray:
        flags = pixels.flags
        if pixels.dtype == np.uint8 and flags.c_contiguous and flags.writeable and flags.owndata:
            return pixels  # made for this image alone (a conversion's output)
        return np.array(pixels, dtype=np.uint8, order="C")


heap_pixels = HeapPixels()

# The smallest pixels a caller accepts, as (width, height), or a rule giving it from the
# image's (upright) size; None: the whole image.
MinSize = tuple[int, int] | Callable[[int, int], tuple[int, int] | None] | None


@dataclass(frozen=True)
class DecodedImage:
    """The pixels, and the size of the image they show (larger when decoded scaled)."""

    pixels: np.ndarray  # uint8 [h, w, 3], C-contiguous, writable; h <= height, w <= width
    width: int  # of the image, upright: what responses say and masks are sized to
    height: int

    @property
    def pixel_size(self) -> tuple[int, int]:
        """(width, height) of the pixels."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])

    @property
    def scaled(self) -> bool:
        return self.pixel_size != (self.width, self.height)


def sha256_hex(data: bytes) -> str:
    """The image_id: the SHA-256 of the file bytes as the client sent them."""
    return hashlib.sha256(data).hexdigest()


_WHITESPACE = re.compile(r"[ \t\r\n]+")
# `warnings.catch_warnings` swaps a process-wide filter list: one decode thread at a time.
_OPEN_LOCK = threading.Lock()


def decode_base64_image(text: str, *, max_bytes: int) -> bytes:
    """The file bytes of a base64 field (standard alphabet, padding required).

    Line breaks and spaces are allowed (what `base64` without `-w0` writes, RFC 2045);
    anything else outside the alphabet is a 400.
    """
    if len(text) // 4 * 3 > max_bytes:
        raise ServiceError(
            413, "payload_too_large", f"the image is over the limit of {max_bytes} bytes"
        )
    if text.startswith("data:"):
        raise ServiceError(
            400, "bad_image", "'image' is a data: URL; send only the base64 after its comma"
        )
    try:
        return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        error = exc
    if _WHITESPACE.search(text):
        try:
            return binascii.a2b_base64(_WHITESPACE.sub("", text).encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            error = exc
    raise ServiceError(400, "bad_image", f"'image' is not valid base64: {error}")


def _bad(message: str) -> ServiceError:
    return ServiceError(400, "bad_image", message)


def _bomb(exc: Exception) -> ServiceError:
    return ServiceError(413, "image_too_large", f"image refused before decoding: {exc}")


def open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Open lazily (header only) and refuse what must not be decoded."""
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            # Our limit is `max_pixels`, checked below; Pillow's warning would only be noise
            # (and one registry entry per distinct size: a slow leak under hostile traffic).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_OPEN_FORMATS)
    except Image.DecompressionBombError as exc:
        raise _bomb(exc) from None
    except UnidentifiedImageError:
        raise _bad("not an image in a supported format (JPEG, PNG, WebP, BMP, TIFF, GIF)") from None
    except Exception as exc:  # Pillow raises many types for corrupt headers
        raise _bad(f"unreadable image: {type(exc).__name__}: {exc}") from None
    if image.format not in ACCEPTED_FORMATS:
        raise _bad(f"image format {image.format} is not supported")
    width, height = image.size
    if width < 1 or height < 1:
        raise _bad(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ServiceError(
            413,
            "image_too_large",
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}",
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise _bad(f"image is {width}x{height}: sides differ by more than {MAX_ASPECT_RATIO}x")
    if image.format != "MPO" and getattr(image, "is_animated", False):
        if image.format == "TIFF":
            raise _bad("multi-page TIFF is not supported: send a single page")
        raise _bad("animated images are not supported: send a single frame")
    return image


def _to_rgb(image: Image.Image) -> np.ndarray:
    """8-bit RGB `[H, W, 3]` from any mode; alpha is dropped, 16-bit is scaled down."""
    mode = image.mode
    if mode.startswith("I;16"):
        # 16-bit grayscale: keep the high byte rather than clipping everything to white.
        gray = (np.asarray(image) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "I":  # 32-bit integers (TIFF): read as 16-bit, as above
        gray = np.clip(np.asarray(image) >> 8, 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "F":
        gray = np.clip(np.nan_to_num(np.asarray(image)), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image)  # read-only; `memory` makes the one copy the pixels own


_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height
_JPEG_FORMATS = ("JPEG", "MPO")
# libjpeg-turbo's DCT scalings kept here: 1/8, 1/4, 1/2 (the cheapest; Pillow's draft
# offers these alone). Each side becomes ceil(side / d), in both decoders.
_SCALES = (8, 4, 2)


def _scaled(width: int, height: int, d: int) -> tuple[int, int]:
    return -(-width // d), -(-height // d)


# The models' resize rules, in plain integers (the frontend has no torch): each matches
# its counterpart in models/ (tests/server/test_imaging.py checks them against it).
def _longest_side_size(width: int, height: int, target: int) -> tuple[int, int]:
    """(w, h) with the longest side at `target`: `models.sam.transforms`' rounding."""
    scale = target * 1.0 / max(width, height)
    return int(width * scale + 0.5), int(height * scale + 0.5)


def _shorter_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(w, h) with the shorter side at `size`: `models.swin.transforms`' (torchvision's)."""
    if height <= width:
        return int(size * width / height), size
    return size, int(size * height / width)


def sam_min_size(width: int, height: int, image_size: int) -> tuple[int, int] | None:
    """The smallest scaled decode SAM can take for an image of `width` x `height` (its
    upright size): the long side still at least `image_size` (the resize only shrinks)
    and the resized image exactly the size the whole image resizes to, so the model input
    and the prompts' and masks' frames are unchanged. None: decode it whole (it is small,
    or no scale keeps the resize's rounding)."""
    if max(width, height) <= image_size:
        return None
    target = _longest_side_size(width, height, image_size)
    for d in _SCALES:
        w, h = _scaled(width, height, d)
        if max(w, h) >= image_size and _longest_side_size(w, h, image_size) == target:
            return w, h
    return None


def square_min_size(width: int, height: int, image_size: int) -> tuple[int, int] | None:
    """As `sam_min_size` for SAM 2, which resizes the whole image to an `image_size`
    square whatever its shape: both sides still at least `image_size` (the resize only
    shrinks), so the model input keeps its size and the prompts' and masks' frames (the
    image's own size) are unchanged. None: decode it whole."""
    for d in _SCALES:
        w, h = _scaled(width, height, d)
        if min(w, h) >= image_size:
            return w, h
    return None


def swin_min_size(width: int, height: int, resize_size: int) -> tuple[int, int] | None:
    """As `sam_min_size` for Swin's eval transform: the shorter side still at least
    `resize_size` (`int(input_size / crop_pct)`, `SwinConfig.resize_size`) and the resized
    image (hence its centre crop) exactly as the whole image's."""
    if min(width, height) <= resize_size:
        return None
    target = _shorter_side_size(width, height, resize_size)
    for d in _SCALES:
        w, h = _scaled(width, height, d)
        if min(w, h) >= resize_size and _shorter_side_size(w, h, resize_size) == target:
            return w, h
    return None


def _scale_for(width: int, height: int, min_size: MinSize) -> int:
    """The largest reduction d (8, 4, 2; 1: none) keeping the pixels at least `min_size`."""
    wanted = min_size(width, height) if callable(min_size) else min_size
    if wanted is None:
        return 1
    for d in _SCALES:
        w, h = _scaled(width, height, d)
        if w >= wanted[0] and h >= wanted[1]:
            return d
    return 1


def exif_orientation(image: Image.Image) -> int | None:
    """The EXIF orientation (1: upright), None when the EXIF block is damaged."""
    try:
        return int(image.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: Pillow's path reports or ignores it
        return None


def _decode_plain_jpeg(
    data: bytes, image: Image.Image, memory: PixelMemory, scale: int
) -> np.ndarray | None:
    """An upright 8-bit RGB or grayscale JPEG decoded by libjpeg-turbo straight into
    `memory` (simplejpeg), at 1/`scale` of its size, or None when anything else should
    decode it.

    Pillow's path holds the GIL while it copies the decoded image out (`tobytes`, about
    3 ms for a 2.8 MP photo on the 2-core CPU, `python -m bench.host_costs`) and then
    once more into memory; this path decodes with the GIL released and writes the
    pixels once. The pixels are the same: on the test photos they are equal to Pillow's,
    byte for byte (tests/server/test_imaging.py). Rotated (EXIF), CMYK or damaged
    files, which simplejpeg refuses strictly, go the Pillow way with its error messages.
    """
    # MPO: a JPEG whose primary image comes first (phones' portrait shots); libjpeg-turbo
    # stops at its end, which is the frame Pillow's path serves
    if image.format not in _JPEG_FORMATS or image.mode not in ("RGB", "L"):
        return None
    width, height = _scaled(*image.size, scale)
    # at a scale, both sides as asked (each is a minimum; the scale that meets both
    # exactly is the one chosen), checked against simplejpeg's own answer first
    wanted = {"min_width": width, "min_height": height} if scale > 1 else {}
    try:
        if scale > 1 and simplejpeg.decode_jpeg_header(data, **wanted)[:2] != (height, width):
            return None
        out = memory.empty((height, width, 3))
        decoded = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out, strict=True, **wanted)
    except Exception:  # ValueError for damaged data; whatever it is, Pillow's path decides
        return None
    if decoded.shape != (height, width, 3):  # the header Pillow read disagrees: let it decide
        return None
    return out


def _draft(image: Image.Image, scale: int) -> bool:
    """Ask Pillow's JPEG decoder for 1/`scale` of the stored image; True when it will.

    Pillow picks d from `size // requested` (floored to 8, 4, 2, 1), so asking for
    `size // scale` gets exactly `scale` on any image large enough to be scaled.
    """
    width, height = image.size
    image.draft(None, (width // scale, height // scale))
    return image.size == _scaled(width, height, scale)


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    max_bytes: int,
    memory: PixelMemory = heap_pixels,
    min_size: MinSize = None,
) -> DecodedImage:
    """Decode, orient and convert one image file; raise `ServiceError` for bad input.

    `memory` gives the buffer the pixels land in (the engine's image memory, pinned or
    shared, filled here in the decode thread). `min_size`, for a JPEG: the pixels may be
    smaller than the image, by 1/2, 1/4 or 1/8, as long as they stay at least this wide
    and high; a callable gets the upright image's (width, height) and answers the same
    (`sam_min_size`, `swin_min_size`). Other formats, and images already small, decode
    whole. The result's width and height are always the image's own.
    """
    if not data:
        raise _bad("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ServiceError(
            413, "payload_too_large", f"the image is over the limit of {max_bytes} bytes"
        )
    image = open_header(data, max_pixels)
    # a JPEG's EXIF is in its header; other formats' getexif may read (and fail on) the
    # pixel data, whose errors must surface from `load` below
    orientation = exif_orientation(image) if image.format in _JPEG_FORMATS else None
    width, height = image.size
    if orientation in _TRANSPOSED:
        width, height = height, width
    scale = 1
    if min_size is not None and orientation is not None:
        scale = _scale_for(width, height, min_size)
    pixels = None
    if orientation == 1:
        pixels = _decode_plain_jpeg(data, image, memory, scale)
    if pixels is not None:
        return DecodedImage(pixels=pixels, width=width, height=height)
    try:
        if scale > 1 and not _draft(image, scale):
            image, scale = open_header(data, max_pixels), 1  # a scale it would not take: whole
        image.load()
        image = ImageOps.exif_transpose(image) or image
        rgb = _to_rgb(image)
    except Image.DecompressionBombError as exc:  # a TIFF tile or GIF frame past Pillow's limit
        raise _bomb(exc) from None
    except Exception as exc:  # truncated or corrupt pixel data
        raise _bad(f"corrupt or truncated image: {type(exc).__name__}: {exc}") from None
    if scale == 1:  # whole: the pixels are the image (as oriented, whatever its EXIF said)
        height, width = int(rgb.shape[0]), int(rgb.shape[1])
    return DecodedImage(pixels=memory.copy_in(rgb), width=width, height=height)
