"""/v1/segment/everything through a real HTTP server: masks, limits, and interleaving."""

from __future__ import annotations

import base64
import json
import threading
import time

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from tests.server.test_api_errors import assert_error

# Random weights predict low IoUs and unstable masks: open the filters so masks survive.
OPEN = {"points_per_side": 8, "pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode(seg: dict) -> np.ndarray:
    return mask_utils.decode({"size": seg["size"], "counts": seg["counts"].encode()})


def test_everything_returns_sorted_decodable_masks(client, jpeg_bytes):
    r = client.post("/v1/segment/everything", json={"image": b64(jpeg_bytes), **OPEN})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (320, 240)
    masks = body["masks"]
    assert len(masks) >= 1
    scores = [m["score"] for m in masks]
    assert scores == sorted(scores, reverse=True)
    for m in masks:
        arr = decode(m["segmentation"])
        assert arr.shape == (240, 320)
        assert m["area"] == int(arr.sum())
        assert 0.0 <= m["stability_score"] <= 1.0
        x, y = m["point_coords"]
        assert 0 <= x <= 320 and 0 <= y <= 240
        assert m["crop_box"] == [0, 0, 320, 240]
    assert {"encode", "generate", "mask_encode", "total"} <= set(body["timing_ms"])


def test_everything_by_image_id_reuses_the_embedding(client, png_bytes):
    first = client.post(
        "/v1/segment/everything",
        files={"image": ("a.png", png_bytes, "image/png")},
        data={"request": json.dumps(OPEN)},
    )
    assert first.status_code == 200, first.text
    image_id = first.json()["image_id"]
    again = client.post("/v1/segment/everything", json={"image_id": image_id, **OPEN})
    assert again.status_code == 200, again.text
    assert again.json()["masks"] == first.json()["masks"]
    # crop layers need the pixels, which an image_id does not carry
    crops = client.post(
        "/v1/segment/everything", json={"image_id": image_id, **OPEN, "crop_n_layers": 1}
    )
    assert_error(crops, 422, "invalid_request")


def test_everything_with_a_crop_layer(client, jpeg_bytes):
    r = client.post(
        "/v1/segment/everything", json={"image": b64(jpeg_bytes), **OPEN, "crop_n_layers": 1}
    )
    assert r.status_code == 200, r.text
    crop_boxes = {tuple(m["crop_box"]) for m in r.json()["masks"]}
    assert crop_boxes  # some masks, each from the full image or one of its 4 crops
    assert all(len(b) == 4 for b in crop_boxes)


@pytest.mark.parametrize(
    "fields",
    [
        {"points_per_side": 0},
        {"points_per_side": 1000},
        {"pred_iou_thresh": 2},
        {"crop_n_layers": 9},
        {"box_nms_thresh": -0.5},
        {"unknown": 1},
        {"output": "gif"},
        {"mask_threshold": 1.0},  # SAM 2's generator only
        {"use_m2m": True},
    ],
)
def test_bad_parameters_are_422(client, jpeg_bytes, fields):
    r = client.post("/v1/segment/everything", json={"image": b64(jpeg_bytes), **fields})
    assert_error(r, 422, "invalid_request")


def test_memory_bound_refuses_before_running(make_server, jpeg_bytes):
    server = make_server(enable_swin=False, everything_max_bytes=1024)
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/segment/everything", json={"image": b64(jpeg_bytes), **OPEN})
        assert_error(r, 413, "everything_too_large")
        assert "points_per_side" in r.json()["error"]["message"]
        # the service still serves
        ok = c.post("/v1/segment", json={"image": b64(jpeg_bytes), "box": [0, 0, 50, 50]})
        assert ok.status_code == 200, ok.text


def test_interactive_requests_interleave_with_a_long_job(make_server, jpeg_bytes):
    """A click answered while a many-step segment-everything job is still running."""
    import httpx

    server = make_server(enable_swin=False, request_timeout_s=600)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        image_id = c.post("/v1/embed", json={"image": b64(jpeg_bytes)}).json()["image_id"]
        long_job = {"image_id": image_id, **OPEN, "points_per_side": 16, "points_per_batch": 2}
        finished: dict[str, float] = {}

        def run_everything() -> None:
            r = httpx.post(server.url + "/v1/segment/everything", json=long_job, timeout=300)
            assert r.status_code == 200, r.text
            finished["everything"] = time.monotonic()

        worker = threading.Thread(target=run_everything)
        worker.start()
        time.sleep(0.3)  # the job is under way: 256 points in 128 chunks of 2
        click = {"image_id": image_id, "point_coords": [[100, 80]], "point_labels": [1]}
        r = c.post("/v1/segment", json=click)
        finished["click"] = time.monotonic()
        assert r.status_code == 200, r.text
        worker.join(timeout=300)
    assert finished["click"] < finished["everything"]
