"""Image bytes -> a validated `uint8 [H, W, 3]` tensor (runs in the decode thread pool).

Everything a client can send wrong about an image is caught here, with the status the
contract gives it: unreadable, truncated or corrupt bytes are 400; images whose header
declares more pixels than allowed are 413 *before* any pixel is decoded (decompression
bombs); the EXIF orientation is applied, and every colour mode the formats carry
(grayscale, palette, alpha, CMYK, 16-bit) becomes 8-bit RGB, so the models see one form.

Pillow's own bomb guard (`Image.MAX_IMAGE_PIXELS`, a process-wide warning) is not our
policy: `max_pixels` is. Its warning is silenced while a header is read, and its hard
error (past twice its limit) is one more 413.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import re
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import simplejpeg
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from models.images import HostPixels, host_pixels
from server.errors import ServiceError

__all__ = ["DecodedImage", "decode_base64_image", "decode_image", "sha256_hex"]

# Formats a camera, a browser or an annotation tool produces. MPO is what many phones
# write for JPEG (a JPEG with extra frames); its first frame is the photo.
ACCEPTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "TIFF", "GIF"})
# Only these decoders are tried: the others (EPS, PSD, ICO, ...) never see client bytes.
_OPEN_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF")
# A side ratio past this would make resize-shortest-side (Swin) explode in size, and
# resize-longest-side (SAM) round the short side to zero pixels.
MAX_ASPECT_RATIO = 64


@dataclass(frozen=True)
class DecodedImage:
    pixels: torch.Tensor  # uint8 [H, W, 3], CPU (pinned when serving on CUDA), contiguous
    width: int
    height: int


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


def _open(data: bytes, max_pixels: int) -> Image.Image:
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
    return np.asarray(image)  # read-only; `memory` makes the one copy the tensor owns


_EXIF_ORIENTATION = 0x0112


def _decode_plain_jpeg(data: bytes, image: Image.Image, memory: HostPixels) -> torch.Tensor | None:
    """An upright 8-bit RGB or grayscale JPEG decoded by libjpeg-turbo straight into
    `memory`'s tensor (simplejpeg), or None when anything else should decode it.

    Pillow's path holds the GIL while it copies the decoded image out (`tobytes`, about
    3 ms for a 2.8 MP photo on the 2-core CPU, `python -m bench.host_costs`) and then
    once more into the tensor; this path decodes with the GIL released and writes the
    pixels once. The pixels are the same: on the test photos they are equal to Pillow's,
    byte for byte (tests/server/test_imaging.py). Rotated (EXIF), CMYK or damaged
    files, which simplejpeg refuses strictly, go the Pillow way with its error messages.
    """
    # MPO: a JPEG whose primary image comes first (phones' portrait shots); libjpeg-turbo
    # stops at its end, which is the frame Pillow's path serves
    if image.format not in ("JPEG", "MPO") or image.mode not in ("RGB", "L"):
        return None
    try:
        if image.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            return None
    except Exception:  # a damaged EXIF block: Pillow's path reports or ignores it
        return None
    width, height = image.size
    out = memory.empty((height, width, 3))
    try:
        buffer = out if isinstance(out, np.ndarray) else out.numpy()
        decoded = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=buffer, strict=True)
    except Exception:  # ValueError for damaged data; whatever it is, Pillow's path decides
        return None
    if decoded.shape != (height, width, 3):  # the header Pillow read disagrees: let it decide
        return None
    return out


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    max_bytes: int,
    memory: HostPixels = host_pixels,
) -> DecodedImage:
    """Decode, orient and convert one image file; raise `ServiceError` for bad input.

    `memory` gives the tensor the pixels land in: the engine's `image_memory`, which on CUDA
    is pinned memory (`models.images.PinnedPixels`), filled here in the decode thread.
    """
    if not data:
        raise _bad("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ServiceError(
            413, "payload_too_large", f"the image is over the limit of {max_bytes} bytes"
        )
    image = _open(data, max_pixels)
    pixels = _decode_plain_jpeg(data, image, memory)
    if pixels is not None:
        return DecodedImage(pixels=pixels, width=int(pixels.shape[1]), height=int(pixels.shape[0]))
    try:
        image.load()
        image = ImageOps.exif_transpose(image) or image
        rgb = _to_rgb(image)
    except Image.DecompressionBombError as exc:  # a TIFF tile or GIF frame past Pillow's limit
        raise _bomb(exc) from None
    except Exception as exc:  # truncated or corrupt pixel data
        raise _bad(f"corrupt or truncated image: {type(exc).__name__}: {exc}") from None
    pixels = memory.copy_in(rgb) if hasattr(memory, "copy_in") else memory(rgb)
    return DecodedImage(pixels=pixels, width=int(pixels.shape[1]), height=int(pixels.shape[0]))
