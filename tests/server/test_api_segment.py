"""/v1/segment and /v1/embed through a real HTTP server: prompts, outputs, RLE, image_id."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from server.imaging import sha256_hex


def multipart(client, image: bytes, fields: dict, path: str = "/v1/segment"):
    files = {"image": ("image.jpg", image, "image/jpeg")}
    return client.post(path, files=files, data={"request": json.dumps(fields)})


def as_json(client, image: bytes, fields: dict, path: str = "/v1/segment"):
    return client.post(path, json={"image": base64.b64encode(image).decode(), **fields})


def check_masks(body: dict, width: int, height: int, per_result: int) -> list[np.ndarray]:
    decoded = []
    for result in body["results"]:
        assert len(result["masks"]) == per_result
        scores = [m["score"] for m in result["masks"]]
        assert scores == sorted(scores, reverse=True)
        for m in result["masks"]:
            rle = m["segmentation"]
            assert rle["size"] == [height, width]
            arr = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()})
            assert arr.shape == (height, width)
            assert m["area"] == int(arr.sum()) == int(mask_utils.area(
                {"size": rle["size"], "counts": rle["counts"].encode()}))  # fmt: skip
            x, y, w, h = m["bbox"]
            if m["area"]:
                ys, xs = np.nonzero(arr)
                assert (x, y) == (xs.min(), ys.min())
                assert (w, h) == (xs.max() - xs.min() + 1, ys.max() - ys.min() + 1)
            decoded.append(arr)
    return decoded


def test_points_multipart(client, jpeg_bytes):
    r = multipart(client, jpeg_bytes, {"point_coords": [[100, 80]], "point_labels": [1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["image_id"] == sha256_hex(jpeg_bytes)
    assert (body["width"], body["height"]) == (320, 240)
    assert len(body["results"]) == 1
    check_masks(body, 320, 240, per_result=1)
    assert body["model"] == {"name": "sam_vit_tiny", "weights": "random", "precision": "fp32"}
    assert {"encode", "decode", "total"} <= set(body["timing_ms"])
    # the waits for a batch are parts of their phases
    timing = body["timing_ms"]
    assert 0 <= timing["decode_queue"] <= timing["decode"]
    assert 0 <= timing.get("encode_queue", 0) <= timing["encode"]
    assert r.headers["x-request-id"]


def test_box_json_base64(client, png_bytes):
    r = as_json(client, png_bytes, {"box": [10, 20, 150, 250]})
    assert r.status_code == 200, r.text
    check_masks(r.json(), 200, 300, per_result=1)


def test_several_boxes_give_one_result_each(client, jpeg_bytes):
    boxes = [[0, 0, 100, 100], [50, 50, 300, 200], [10, 100, 60, 230]]
    r = as_json(client, jpeg_bytes, {"boxes": boxes})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["results"]) == 3
    check_masks(body, 320, 240, per_result=1)


def test_multimask_gives_three_sorted(client, jpeg_bytes):
    fields = {"point_coords": [[100, 80], [200, 200]], "point_labels": [1, 0],
              "box": [50, 40, 250, 230], "multimask_output": True}  # fmt: skip
    r = multipart(client, jpeg_bytes, fields)
    assert r.status_code == 200, r.text
    check_masks(r.json(), 320, 240, per_result=3)


def test_same_image_by_id_gives_the_same_masks(client, real_photo):
    fields = {"point_coords": [[400, 260]], "point_labels": [1]}
    first = multipart(client, real_photo, fields)
    assert first.status_code == 200, first.text
    image_id = first.json()["image_id"]
    again = client.post("/v1/segment", json={"image_id": image_id, **fields})
    assert again.status_code == 200, again.text
    assert again.json()["results"] == first.json()["results"]
    assert (again.json()["width"], again.json()["height"]) == (800, 534)


def test_embed_then_segment_by_id(client, png_bytes):
    r = client.post("/v1/embed", files={"image": ("a.png", png_bytes, "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["image_id"] == sha256_hex(png_bytes)
    again = client.post("/v1/embed", json={"image": base64.b64encode(png_bytes).decode()})
    assert again.json()["cached"] is True
    seg = client.post("/v1/segment", json={"image_id": body["image_id"], "box": [0, 0, 50, 50]})
    assert seg.status_code == 200, seg.text


@pytest.mark.parametrize("output", ["png", "polygons"])
def test_other_outputs(client, jpeg_bytes, output):
    r = as_json(client, jpeg_bytes, {"box": [40, 40, 200, 200], "output": output})
    assert r.status_code == 200, r.text
    seg = r.json()["results"][0]["masks"][0]["segmentation"]
    assert seg["size"] == [240, 320]
    assert output in seg
