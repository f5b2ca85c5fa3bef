"""Refinement over HTTP (click, get a low-res handle, click again with it as mask_input)
gives what Meta's SamPredictor gives with the same clicks and the same mask_input, on the
same random weights loaded from an official-format checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from pycocotools import mask as mask_utils

from models.sam import SAM_CONFIGS
from models.sam.transforms import resize_longest_side_size
from tests.reference_sam import build_reference_sam, randomize_reference
from tests.server.conftest import PHOTOS, LiveServer, small_settings
from tests.server.test_api_errors import assert_error

CONFIG = SAM_CONFIGS["vit_tiny"]
CLICK_1 = [[400.0, 260.0]]
CLICK_2 = [[400.0, 260.0], [150.0, 120.0]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    model = build_reference_sam(CONFIG)
    randomize_reference(model, seed=99)
    path = tmp_path_factory.mktemp("refine") / "sam_vit_tiny.pth"
    torch.save(model.state_dict(), path)
    return model, path


@pytest.fixture(scope="module")
def server(reference: tuple[object, Path]) -> Iterator[LiveServer]:
    live = LiveServer(
        small_settings(
            enable_swin=False,
            sam_checkpoint=reference[1],
            low_res_cache_bytes=2**20,
            scaled_decode=False,
        )  # parity with the predictor: whole decodes
    ).start()
    yield live
    live.stop()


def predictor_for(model: object, photo: np.ndarray):  # -> SamPredictor
    """Meta's predictor on the photo, resized the way our service resizes (on floats).

    Meta's `set_image` resizes through PIL on uint8; our service resizes on floats, so the
    same resized image is handed to `set_torch_image` to compare the models alone.
    """
    from segment_anything import SamPredictor

    predictor = SamPredictor(model)
    h, w = photo.shape[:2]
    size = resize_longest_side_size(h, w, CONFIG.image_size)
    x = torch.from_numpy(photo).permute(2, 0, 1)[None].float()
    resized = F.interpolate(x, size, mode="bilinear", align_corners=False, antialias=True)
    predictor.set_torch_image(resized, (h, w))
    return predictor


def decode(mask: dict) -> np.ndarray:
    seg = mask["segmentation"]
    return mask_utils.decode({"size": seg["size"], "counts": seg["counts"].encode()}).astype(bool)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max((a | b).sum(), 1))


def test_refinement_matches_sam_predictor(server: LiveServer, reference: tuple[object, Path]):
    data = (PHOTOS / "dog.jpg").read_bytes()
    photo = np.array(Image.open(PHOTOS / "dog.jpg").convert("RGB"))
    predictor = predictor_for(reference[0], photo)

    with httpx.Client(base_url=server.url, timeout=60) as c:
        first = c.post(
            "/v1/segment",
            files={"image": ("dog.jpg", data, "image/jpeg")},
            data={"request": json.dumps({"point_coords": CLICK_1, "point_labels": [1],
                   "multimask_output": True, "return_low_res_logits": True})},
        )  # fmt: skip
        assert first.status_code == 200, first.text
        body = first.json()
        masks = body["results"][0]["masks"]
        assert len(masks) == 3 and all(len(m["low_res_handle"]) == 32 for m in masks)
        best = masks[0]  # sorted by score: the predictor's argmax
        refine = {"image_id": body["image_id"], "point_coords": CLICK_2,
                  "point_labels": [1, 0], "mask_input": best["low_res_handle"]}  # fmt: skip
        second = c.post("/v1/segment", json=refine)
        assert second.status_code == 200, second.text
        plain = c.post("/v1/segment", json={**refine, "mask_input": None})
        ours_refined = decode(second.json()["results"][0]["masks"][0])
        ours_plain = decode(plain.json()["results"][0]["masks"][0])

    ref_masks, ref_scores, ref_low = predictor.predict(
        np.array(CLICK_1), np.array([1]), multimask_output=True
    )
    k = int(np.argmax(ref_scores))
    assert iou(decode(best), ref_masks[k]) > 0.98
    assert best["score"] == pytest.approx(float(ref_scores[k]), abs=1e-3)
    ref_refined, _, _ = predictor.predict(
        np.array(CLICK_2), np.array([1, 0]), mask_input=ref_low[k][None], multimask_output=False
    )
    ref_plain, _, _ = predictor.predict(np.array(CLICK_2), np.array([1, 0]), multimask_output=False)
    # the mask input changes the answer, for Meta's predictor and for us the same way
    assert iou(ref_refined[0], ref_plain[0]) < 0.99
    assert iou(ours_refined, ref_refined[0]) > 0.98
    assert iou(ours_plain, ref_plain[0]) > 0.98


def test_mask_input_errors(server: LiveServer, jpeg_bytes: bytes, png_bytes: bytes):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        a = c.post("/v1/segment", files={"image": ("a.jpg", jpeg_bytes, "image/jpeg")},
                   data={"request": json.dumps({"box": [10, 10, 90, 90],
                                                "return_low_res_logits": True})})  # fmt: skip
        handle = a.json()["results"][0]["masks"][0]["low_res_handle"]
        b = c.post("/v1/embed", files={"image": ("b.png", png_bytes, "image/png")}).json()
        other = c.post("/v1/segment", json={"image_id": b["image_id"], "mask_input": handle})
        assert_error(other, 422, "invalid_request")
        unknown = c.post("/v1/segment", json={"image_id": b["image_id"], "mask_input": "f" * 32})
        assert_error(unknown, 404, "unknown_mask_input")
        malformed = c.post("/v1/segment", json={"image_id": b["image_id"], "mask_input": "xyz"})
        assert_error(malformed, 422, "invalid_request")
        # a mask input alone is a prompt, as in SAM's predictor
        alone = c.post("/v1/segment", json={"image_id": a.json()["image_id"], "mask_input": handle})
        assert alone.status_code == 200, alone.text
