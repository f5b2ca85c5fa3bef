"""Every bad input of DESIGN.md's list gets its status and error code, never a 500."""

from __future__ import annotations

import base64
import json
import struct
import zlib

import pytest

from tests.server.conftest import encode, photo_like

GOOD = {"point_coords": [[10, 10]], "point_labels": [1]}


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims a huge size (a decompression bomb's calling card)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_error(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("zero bytes", b""),
        ("text named .jpg", b"hello, I am not a picture\n" * 20),
        ("truncated jpeg", encode(photo_like(120, 90), "JPEG")[:400]),
        ("truncated png", encode(photo_like(120, 90), "PNG")[:300]),
    ],
)
def test_unreadable_images_are_400(client, name, data):
    r = client.post("/v1/segment", json={"image": b64(data), **GOOD})
    assert_error(r, 400, "bad_image")


def test_bad_base64_is_400(client):
    r = client.post("/v1/segment", json={"image": "@@@ not base64 @@@", **GOOD})
    assert_error(r, 400, "bad_image")


def test_decompression_bomb_is_413(client):
    r = client.post("/v1/segment", json={"image": b64(png_declaring(30000, 30000)), **GOOD})
    assert_error(r, 413, "image_too_large")


def test_body_over_limit_is_413(client, live_server):
    big = b"x" * (live_server.settings.max_body_bytes + 10)
    r = client.post("/v1/segment", content=big, headers={"content-type": "application/json"})
    assert_error(r, 413, "payload_too_large")


def test_unknown_image_id_is_404(client):
    r = client.post("/v1/segment", json={"image_id": "0" * 64, **GOOD})
    assert_error(r, 404, "unknown_image_id")


@pytest.mark.parametrize("ctype", ["text/plain", "image/jpeg", "application/xml"])
def test_wrong_media_type_is_415(client, ctype):
    r = client.post("/v1/segment", content=b"abc", headers={"content-type": ctype})
    assert_error(r, 415, "unsupported_media_type")


@pytest.mark.parametrize(
    "fields",
    [
        {"point_coords": [[1, 2], [3, 4]], "point_labels": [1]},  # lengths differ
        {"point_coords": [[1, 2]], "point_labels": [2]},  # label not 0/1
        {"point_coords": [[1, 2]]},  # labels missing
        {"box": [50, 10, 20, 40]},  # x1 < x0
        {"box": [10, 50, 20, 40]},  # y1 < y0
        {"box": [1, 2, 3]},  # wrong length
        {"boxes": []},
        {"box": [0, 0, 5, 5], "boxes": [[0, 0, 5, 5]]},
        {},  # no prompt at all
        {"point_coords": [[1, 2]], "point_labels": [1], "surprise": True},  # unknown field
        {"box": [0, 0, 5, 5], "output": "jpeg"},
        {"point_coords": [[1, 2]] * 1000, "point_labels": [1] * 1000},  # over max_points
    ],
)
def test_invalid_fields_are_422(client, jpeg_bytes, fields):
    r = client.post("/v1/segment", json={"image": b64(jpeg_bytes), **fields})
    assert_error(r, 422, "invalid_request")


def test_nan_and_infinity_are_422(client, jpeg_bytes):
    for bad in ("NaN", "Infinity", "-Infinity"):
        image = b64(jpeg_bytes)
        body = f'{{"image": "{image}", "point_coords": [[{bad}, 1]], "point_labels": [1]}}'
        r = client.post("/v1/segment", content=body, headers={"content-type": "application/json"})
        assert_error(r, 422, "invalid_request")


def test_image_and_image_id_together_is_422(client, jpeg_bytes):
    r = client.post("/v1/segment", json={"image": b64(jpeg_bytes), "image_id": "a" * 64, **GOOD})
    assert_error(r, 422, "invalid_request")


def test_malformed_json_is_400(client):
    r = client.post(
        "/v1/segment", content=b'{"image": ', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_json")


def test_deeply_nested_json_is_422(client):
    deep = "[" * 5000 + "]" * 5000
    body = f'{{"image": "x", "point_coords": {deep}}}'
    r = client.post("/v1/segment", content=body, headers={"content-type": "application/json"})
    assert_error(r, 422, "invalid_request")


def test_multipart_without_image_part_is_422(client):
    r = client.post("/v1/segment", data={"request": json.dumps(GOOD)}, files={"x": ("a", b"1")})
    assert r.status_code == 422, r.text


def test_multipart_with_bad_request_json(client, jpeg_bytes):
    files = {"image": ("a.jpg", jpeg_bytes, "image/jpeg")}
    r = client.post("/v1/segment", files=files, data={"request": "{not json"})
    assert_error(r, 400, "invalid_json")


def test_classify_top_k_out_of_range_is_422(client, jpeg_bytes):
    r = client.post("/v1/classify", json={"image": b64(jpeg_bytes), "top_k": 0})
    assert_error(r, 422, "invalid_request")


def test_unknown_route_uses_the_envelope(client):
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    assert_error(client.get("/v1/segment"), 405, "method_not_allowed")


def test_service_still_serves_after_bad_input(client, jpeg_bytes):
    client.post("/v1/segment", json={"image": b64(b"garbage"), **GOOD})
    r = client.post("/v1/segment", json={"image": b64(jpeg_bytes), **GOOD})
    assert r.status_code == 200, r.text
