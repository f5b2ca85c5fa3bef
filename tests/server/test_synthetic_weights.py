"""`python -m server` with SERVE_SAM_CHECKPOINT at synthetic weights (tests/conftest.py,
`synthetic_checkpoint`): the service says "synthetic" in /v1/models and every response, and
a point gives its disc with a score in [0, 1]; the same file without its sidecar
is named by its file, like any checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from models.sam import SAM_CONFIGS
from models.sam.shapes import ShapePrompts, shape_masks
from models.sam.transforms import resize_longest_side_size, scale_coords
from tests.conftest import SYNTHETIC_TIMEOUT_S, photo_like_array
from tests.models.test_synthesize import MIN_HELDOUT_IOU
from tests.server.conftest import encode, free_port, spawn_server, stop_server, wait_until_ready

WIDTH, HEIGHT = 400, 300
POINT = [180, 140]


def expected_disc(point: list[int]) -> np.ndarray:
    """The point's disc drawn at the photo's size, as the service maps pixels to the model."""
    config = SAM_CONFIGS["vit_tiny"]
    xy = scale_coords(torch.tensor([[point]], dtype=torch.float32), (HEIGHT, WIDTH), config)
    points = torch.cat([xy, torch.zeros(1, 1, 2)], dim=1)  # [1, 2, 2]
    prompt = ShapePrompts(
        torch.zeros(1, 4), torch.tensor([False]), points, torch.tensor([[1, -1]]), torch.zeros(1)
    )
    newh, neww = resize_longest_side_size(HEIGHT, WIDTH, config.image_size)
    xs = torch.arange(WIDTH, dtype=torch.float64) * (neww / WIDTH)
    ys = torch.arange(HEIGHT, dtype=torch.float64) * (newh / HEIGHT)
    return shape_masks(prompt, xs.float(), ys.float(), config.image_size, (1.0,))[0, 0].numpy()


@pytest.mark.timeout(SYNTHETIC_TIMEOUT_S)
def test_server_reports_synthetic_weights_and_draws_the_disc(synthetic_checkpoint, tmp_path):
    path, _ = synthetic_checkpoint
    port = free_port()
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_SAM_CHECKPOINT": str(path), "SERVE_SWIN_MODEL": "swin_test",
           "SERVE_MAX_BATCH_SIZE": "2", "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
           "SERVE_LOG_LEVEL": "INFO"}  # fmt: skip
    log = (tmp_path / "server.log").open("w+")
    proc = spawn_server(env, port, log)
    photo = encode(Image.fromarray(photo_like_array(HEIGHT, WIDTH, seed=21)), "JPEG", quality=92)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(proc, url, tmp_path / "server.log", 240)
        models = {m["name"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["models"]}
        assert models["sam_vit_tiny"]["weights"] == "synthetic"
        assert models["swin_test"]["weights"] == "random"
        r = httpx.post(url + "/v1/segment", timeout=60,
                       files={"image": ("photo.jpg", photo, "image/jpeg")},
                       data={"request": json.dumps({"point_coords": [POINT],
                                                    "point_labels": [1]})})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"]["weights"] == "synthetic"
        (mask,) = body["results"][0]["masks"]
        assert 0.0 <= mask["score"] <= 1.0
        rle = mask["segmentation"]
        got = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()}) > 0
        want = expected_disc(POINT)
        assert (got & want).sum() / (got | want).sum() >= MIN_HELDOUT_IOU["point"]
        # a shape, not noise: a few runs per row, not hundreds of thousands
        assert len(rle["counts"]) < 2000
    finally:
        stop_server(proc, tmp_path / "server.log")
        log.close()
    out = (tmp_path / "server.log").read_text()
    assert "sam_vit_tiny has SYNTHETIC weights" in out
    assert "SAM vit_tiny has seeded RANDOM weights" not in out


@pytest.mark.timeout(SYNTHETIC_TIMEOUT_S)
def test_without_its_sidecar_the_file_is_named_like_any_checkpoint(
    synthetic_checkpoint, make_server, tmp_path
):
    path, _ = synthetic_checkpoint
    bare = tmp_path / "some_checkpoint.pth"
    shutil.copy(path, bare)
    server = make_server(sam_checkpoint=bare)
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["models"]
    sam = next(m for m in models if m["name"] == "sam_vit_tiny")
    assert sam["weights"] == "some_checkpoint.pth"
