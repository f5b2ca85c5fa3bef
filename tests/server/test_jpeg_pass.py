"""JPEG files decoded by the engine (`SERVE_JPEG_DECODE`): which files a frontend passes on
undecoded, the engine's batched decoder, and the whole path through a live server, whose
answers must be the ones the frontends' own decoding gives.

On the CPU the engine decodes with libjpeg-turbo (`engine` mode), the path nvJPEG takes on
a GPU with another decoder function; bench/jpeg_decode.py measures nvJPEG on the H100.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from bench.common import DEFAULT_IMAGES
from server import imaging
from server.engine import jpeg
from server.errors import ServiceError
from server.http import jpeg_pass
from server.imaging import HeapPixels
from tests.conftest import PHOTOS
from tests.server.conftest import encode, photo_like
from tests.server.test_http_faults import metric

LIMITS = {"max_pixels": 8_000_000, "max_bytes": 4 << 20}
SHARED_PHOTOS = DEFAULT_IMAGES


def passed(data: bytes) -> jpeg_pass.JpegFile | None:
    return jpeg_pass.for_engine(data, memory=HeapPixels(), **LIMITS)


def bad_component(data: bytes) -> bytes:
    """The same file with its scan naming a component the frame lacks: the header reads,
    every decoder refuses the data."""
    sos = data.index(b"\xff\xda")
    broken = bytearray(data)
    broken[sos + 5] = 99  # the first component selector of the scan header
    return bytes(broken)


def test_the_frame_marker_is_read_past_the_metadata() -> None:
    exif = Image.Exif()
    exif[0x010F] = "camera" * 100  # a long APP1 segment before the frame
    baseline = encode(photo_like(64, 48), exif=exif.tobytes())
    assert jpeg_pass.frame_marker(baseline) == 0xC0
    assert jpeg_pass.frame_marker(encode(photo_like(64, 48), progressive=True)) == 0xC2
    assert jpeg_pass.frame_marker(b"\xff\xd8\xff\xda\x00\x02") is None  # a scan first
    assert jpeg_pass.frame_marker(b"not a jpeg") is None
    assert jpeg_pass.frame_marker(b"\xff\xd8\x00\x00\x00") is None


def test_upright_baseline_files_pass_with_their_bytes_and_size() -> None:
    for image in (photo_like(120, 90), photo_like(120, 90).convert("L")):
        data = encode(image, quality=90)
        file = passed(data)
        assert file is not None
        assert (file.width, file.height) == (120, 90)
        assert file.data.tobytes() == data


def test_what_nvjpeg_would_decode_differently_stays_in_the_frontend() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    whole = encode(photo_like(120, 90))
    for data in (
        encode(photo_like(120, 90), progressive=True),
        encode(photo_like(120, 90), exif=exif.tobytes()),  # rotated
        encode(photo_like(120, 90).convert("CMYK")),
        whole[: len(whole) * 2 // 3],  # truncated: no EOI
        whole + b"\x00\x00",  # bytes after the EOI
        encode(photo_like(64, 48), "PNG"),
    ):
        assert passed(data) is None


def test_progressive_files_pass_when_the_engine_takes_them() -> None:
    # SERVE_JPEG_PROGRESSIVE=engine: nvJPEG decodes them for a third of a frontend's CPU
    for image in (photo_like(120, 90), photo_like(120, 90).convert("L")):
        data = encode(image, progressive=True, quality=90)
        file = jpeg_pass.for_engine(data, memory=HeapPixels(), progressive=True, **LIMITS)
        assert file is not None and (file.width, file.height) == (120, 90)
        assert file.data.tobytes() == data
    # the rest stays in the frontend all the same
    exif = Image.Exif()
    exif[0x0112] = 6
    whole = encode(photo_like(120, 90), progressive=True)
    for data in (
        encode(photo_like(120, 90), progressive=True, exif=exif.tobytes()),  # rotated
        encode(photo_like(120, 90).convert("CMYK"), progressive=True),
        whole[: len(whole) * 2 // 3],  # truncated: no EOI
        encode(photo_like(64, 48), "PNG"),
    ):
        assert jpeg_pass.for_engine(data, memory=HeapPixels(), progressive=True, **LIMITS) is None
    for path in sorted(SHARED_PHOTOS.glob("*.jpg")):  # all seven, the progressive one too
        assert jpeg_pass.engine_decodable(path.read_bytes(), progressive=True, **LIMITS), path


def test_refusals_are_the_decoders_own() -> None:
    with pytest.raises(ServiceError) as empty:
        passed(b"")
    assert empty.value.status == 400
    big = encode(photo_like(4000, 2100), quality=50)  # 8.4 MP, over the 8 MP limit
    with pytest.raises(ServiceError) as caught:
        passed(big)
    assert caught.value.status == 413 and caught.value.code == "image_too_large"
    with pytest.raises(ServiceError) as too_long:
        jpeg_pass.for_engine(big, memory=HeapPixels(), max_pixels=10**9, max_bytes=100)
    assert too_long.value.status == 413 and too_long.value.code == "payload_too_large"


def test_the_shared_photos_pass_but_the_progressive_one() -> None:
    photos = sorted(SHARED_PHOTOS.glob("*.jpg"))
    assert len(photos) >= 7
    for path in photos:
        data = path.read_bytes()
        progressive = jpeg_pass.frame_marker(data) == 0xC2
        assert (passed(data) is None) == progressive, path.name
    assert sum(jpeg_pass.frame_marker(p.read_bytes()) == 0xC2 for p in photos) == 1


def files(*datas: bytes) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]


def test_a_batch_with_a_damaged_file_fails_only_that_file() -> None:
    good = [(PHOTOS / name).read_bytes() for name in ("dog.jpg", "truck.jpg")]
    damaged = bad_component(good[0])
    sizes = [Image.open(io.BytesIO(d)).size[::-1] for d in (good[0], damaged, good[1])]
    decoder = jpeg.JpegDecoder(jpeg.host_decoder)

    async def decode_all() -> list[torch.Tensor | BaseException]:
        calls = [
            submitted(decoder, f, s)
            for f, s in zip(files(good[0], damaged, good[1]), sizes, strict=True)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        first, failed, third = asyncio.run(decode_all())
    finally:
        decoder.close()
    assert isinstance(failed, ServiceError) and failed.status == 400
    assert failed.code == "bad_image"
    for got, data in ((first, good[0]), (third, good[1])):
        assert isinstance(got, torch.Tensor)
        want = imaging.decode_image(data, **LIMITS).pixels
        assert np.array_equal(got.numpy(), want)
    assert decoder.files == 3


async def submitted(
    decoder: jpeg.JpegDecoder, data: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    return await decoder.submit(data, size)


def test_pixels_of_another_size_than_the_header_says_are_refused() -> None:
    def shrinking(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.zeros(4, 5, 3, dtype=torch.uint8) for _ in batch]

    decoder = jpeg.JpegDecoder(shrinking)
    try:
        with pytest.raises(ServiceError) as caught:
            asyncio.run(submitted(decoder, files(b"\xff\xd8")[0], (6, 5)))
    finally:
        decoder.close()
    assert caught.value.status == 400 and "5x6" in caught.value.message


def test_the_setting_chooses_where_files_decode(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    assert jpeg.choose("frontend", cpu) is None
    assert jpeg.choose("auto", cpu) is None  # a CPU engine's cores are the frontends'
    assert jpeg.choose("engine", cpu) is jpeg.host_decoder
    # no nvJPEG here (no CUDA, no real torchvision): auto falls back, engine refuses
    with caplog.at_level(logging.WARNING, logger="server.engine.jpeg"):
        assert jpeg.choose("auto", torch.device("cuda")) is None
    assert "decoded by the frontends" in caplog.text
    with pytest.raises(RuntimeError, match="SERVE_JPEG_DECODE=engine"):
        jpeg.choose("engine", torch.device("cuda"))
    # auto: Swin's images too where its stage resizes a batch in two launches (CUDA)
    assert jpeg.models_for("auto", swin_batched=False) == ("sam",)
    assert jpeg.models_for("auto", swin_batched=True) == ("sam", "swin")
    for batched in (False, True):
        assert jpeg.models_for("engine", batched) == ("sam", "swin")
        assert jpeg.models_for("frontend", batched) == ()


def decoded_by_engine(url: str) -> float:
    return metric(url, "serve_phase_duration_seconds_count", phase="jpeg_decode")


def test_the_engine_decodes_what_the_frontend_passes(make_server) -> None:
    """Same answers as a frontend's whole decode, for a passed JPEG and for the files the
    frontend keeps; a damaged file is a 400; every shared-memory slot comes back."""
    engine = make_server(jpeg_decode="engine", jpeg_progressive="frontend", scaled_decode=False)
    progressive_too = make_server(jpeg_decode="engine", scaled_decode=False)  # the default
    frontend = make_server(jpeg_decode="frontend", scaled_decode=False)
    photo = (PHOTOS / "dog.jpg").read_bytes()
    progressive = encode(Image.open(io.BytesIO(photo)), progressive=True, quality=90)
    png = encode(photo_like(200, 150), "PNG")
    box = {"request": '{"box": [40, 30, 500, 400]}'}
    answers = []
    timed = []  # which responses' timing_ms held the engine's jpeg_decode
    for server in (engine, progressive_too, frontend):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            got = []
            for data in (photo, progressive, png):
                image = {"image": ("p", data, "application/octet-stream")}
                classified = c.post("/v1/classify", files=image)
                segmented = c.post("/v1/segment", files=image, data=box)
                assert classified.status_code == segmented.status_code == 200
                got.append((classified.json()["predictions"], segmented.json()["results"]))
                timed += [
                    r.json()["timing_ms"].get("jpeg_decode", -1) > 0
                    for r in (classified, segmented)
                ]
            answers.append(got)
    assert answers[0] == answers[1] == answers[2]
    # the engine's decode is in the response's timing_ms, as its metric is, for the
    # JPEGs it decoded and no other (OBSERVABILITY.md): the baseline photo; with
    # SERVE_JPEG_PROGRESSIVE=engine the progressive one too
    assert timed == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 8, timed
    assert engine.app.state.serve.engine.status.jpeg_models == ("sam", "swin")
    assert decoded_by_engine(engine.url) == 2  # the baseline photo, twice
    assert decoded_by_engine(progressive_too.url) == 4  # and the progressive one
    assert decoded_by_engine(frontend.url) == 0

    damaged = {"image": ("d.jpg", bad_component(photo), "image/jpeg")}
    refused = httpx.post(engine.url + "/v1/classify", files=damaged, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "bad_image"
    pixels = engine.app.state.serve.pixels
    deadline = time.monotonic() + 10  # releases come back on the engine's socket
    while pixels.slots > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pixels.slots == 0 and pixels.spilled == 0


def test_a_file_too_large_for_shared_memory_goes_inline_and_is_counted(make_server) -> None:
    server = make_server(jpeg_decode="engine", scaled_decode=False, shm_bytes_per_worker=64 << 10)
    photo = (PHOTOS / "dog.jpg").read_bytes()  # 100 KB: more than the 64 KiB file
    small = encode(photo_like(64, 48), quality=90)  # fits
    png = encode(photo_like(200, 150), "PNG")  # decoded here: 90,000 bytes of pixels, inline
    answers = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for data in (photo, small, png):
            answer = c.post("/v1/classify", files={"image": ("p", data, "image/jpeg")})
            assert answer.status_code == 200, answer.text
            answers.append(answer.json()["predictions"])
    assert metric(server.url, "serve_pixels_inline_total") == 2
    assert decoded_by_engine(server.url) == 2  # both JPEGs decoded by the engine
    # the same answers as with room in shared memory
    roomy = make_server(jpeg_decode="engine", scaled_decode=False)
    with httpx.Client(base_url=roomy.url, timeout=60) as c:
        for data, want in zip((photo, small, png), answers, strict=True):
            answer = c.post("/v1/classify", files={"image": ("p", data, "image/jpeg")})
            assert answer.json()["predictions"] == want
    assert metric(roomy.url, "serve_pixels_inline_total") == 0
