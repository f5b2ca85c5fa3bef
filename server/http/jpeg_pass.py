"""A JPEG file passed to the engine undecoded, for its GPU to decode (`server.engine.jpeg`).

The frontend still reads the header, so every refusal a client can get is the same as
when it decodes (`imaging.open_header`: 400 for what is not an image, 413 past
`max_pixels`, the aspect ratio); it then copies the file's bytes where it would have put
the pixels (its shared memory). Only files the GPU decodes exactly as the frontend would
go this way: an upright (EXIF orientation 1, or none) baseline JPEG (SOF0: 8-bit,
sequential, Huffman-coded; what nvJPEG's hardware decodes) in RGB or grayscale, ending in
its EOI marker (a truncated file, which libjpeg would pad with grey, is left to the
frontend's decoder and its message). Everything else (arithmetic-coded, CMYK, rotated, MPO,
other formats) decodes here as before.

Progressive JPEGs (SOF2) go too under `SERVE_JPEG_PROGRESSIVE=engine` (the default;
`frontend` keeps them here). nvJPEG decodes them with its own Huffman decoder on the
engine's host cores, not the GPU's hardware, but for a third of libjpeg-turbo's CPU: the
2048x1365 progressive test photo took 22.1 ms of a core at Swin's scale and 28.9 at SAM's in
a frontend, against 8.6 and 7.5 ms through the engine's decoder (H200 host, 2026-11-27,
`python -m bench.jpeg_decode`), with pixels 0.015 levels from libjpeg-turbo's on average (at
most 3). One photo in seven of that kind made classify @2,000/s miss its p99 (1.4 s against
36 ms with the baseline photos alone): docs/BENCHMARKS.md, issue 19, twentieth session. With
the engines decoding it, classify @2,000/s held p99 100.6 ms where the frontends' decode
took it to 4.2 s on the same H200, 55.8 ms on another (twenty-first session). torchvision
decodes them in a `torch.ops` call, and such calls release the GIL (seen on the CPU with
another op).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server import imaging
from server.errors import ServiceError

_SOI, _EOI = b"\xff\xd8", b"\xff\xd9"
_BASELINE, _PROGRESSIVE = 0xC0, 0xC2  # SOF0, SOF2 (both Huffman-coded, 8-bit)
# markers that are frames (SOF1..SOF15 but DHT C4, JPG C8, DAC CC): any but SOF0 (and SOF2
# unless SERVE_JPEG_PROGRESSIVE=frontend) is decoded in the frontend
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length follows
_HEADER_SCAN = 1 << 20  # a frame header past this many bytes of metadata: not ours


@dataclass(frozen=True)
class JpegFile:
    """The file's bytes, where the engine will read them, and the image's size."""

    data: np.ndarray  # uint8 [n]
    width: int
    height: int


def frame_marker(data: bytes) -> int | None:
    """The JPEG's frame (SOFn) marker, from its segment headers; None when they are not
    well formed (the frontend's decoder then says why)."""
    if not data.startswith(_SOI):
        return None
    at, end = 2, min(len(data), _HEADER_SCAN)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill bytes before a marker
            at += 1
            continue
        if marker in _FRAMES:
            return marker
        if marker in _STANDALONE:
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or scan data before any frame header
            return None
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def engine_decodable(
    data: bytes, *, max_pixels: int, max_bytes: int, progressive: bool = False
) -> tuple[int, int] | None:
    """The image's (width, height) when the engine's decoder gives the frontend's pixels
    for it (progressive files too when `progressive`); None when the frontend should decode
    it (`imaging.decode_image`). Bad input raises as decoding would."""
    if not data:
        raise ServiceError(400, "bad_image", "the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ServiceError(
            413, "payload_too_large", f"the image is over the limit of {max_bytes} bytes"
        )
    frames = (_BASELINE, _PROGRESSIVE) if progressive else (_BASELINE,)
    if not data.endswith(_EOI) or frame_marker(data) not in frames:
        return None
    image = imaging.open_header(data, max_pixels)
    if image.format != "JPEG" or image.mode not in ("RGB", "L"):
        return None
    if imaging.exif_orientation(image) != 1:
        return None
    width, height = image.size
    return width, height


def for_engine(
    data: bytes,
    *,
    max_pixels: int,
    max_bytes: int,
    memory: imaging.PixelMemory,
    progressive: bool = False,
) -> JpegFile | None:
    """The file, copied into `memory`, when the engine should decode it (as
    `engine_decodable`); None when the frontend should."""
    size = engine_decodable(
        data, max_pixels=max_pixels, max_bytes=max_bytes, progressive=progressive
    )
    if size is None:
        return None
    out = memory.empty((len(data),))
    out[:] = np.frombuffer(data, dtype=np.uint8)
    return JpegFile(out, *size)
