"""SAM 2.1's segment everything through the real server (`sam2_test_tiny`, CPU).

The served masks must equal `Sam2AutomaticMaskGenerator` run directly on the same weights
and pixels: same count, IoU >= 0.98 mask by mask, same scores. Seeded random weights give
masks that cover most of the image and fail the filters, so the weights are changed to draw
blobs (as `tests/models/test_sam2_automatic.py` does for Meta's model), the IoU head's bias
raised so that scores straddle SAM 2's 0.8 and SAM's 0.88 (the default served must be
SAM 2's), and the request sets a higher `mask_threshold` (a SAM 2 generator field).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

import server.engine.sam2_stages as stages_module
from models.optimize import OptimizeOptions
from models.sam2 import SAM2_CONFIGS, Sam2, load_sam2
from models.sam2.automatic import (
    AutomaticMasks,
    Sam2AutomaticMaskGenerator,
    Sam2AutomaticMaskSettings,
)
from server.engine.sam2_stages import Sam2Stages
from tests.conftest import PHOTOS
from tests.models.sam2_blobs import blob_weights
from tests.server.test_api_errors import assert_error
from tests.server.test_sam2_service import MODEL, save_meta_format

from .conftest import LiveServer, small_settings

CONFIG = SAM2_CONFIGS[MODEL]
PHOTO_SIZE = (256, 171)  # (W, H): dog.jpg at the tiny model's scale, sent as a PNG
IOU_SHIFT = 1.5  # added to the IoU head's logit: scores about 0.80-0.92
MIN_IOU = 0.98

# pred_iou_thresh is left to the served model's default (SAM 2: 0.8)
REQUEST: dict[str, Any] = {
    "points_per_side": 12,
    "stability_score_thresh": 0.6,
    "mask_threshold": 10.0,
}
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "crops": {"crop_n_layers": 1},
    "m2m_single_mask": {"use_m2m": True, "multimask_output": False},
}


@pytest.fixture(scope="module")
def model() -> Sam2:
    return blob_weights(load_sam2(CONFIG, None, seed=0), iou_shift=IOU_SHIFT)


@pytest.fixture(scope="module")
def checkpoint(model: Sam2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_meta_format(model, tmp_path_factory.mktemp("sam2_everything") / "blobs.pt")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    image = Image.open(PHOTOS / "dog.jpg").convert("RGB")
    return np.array(image.resize(PHOTO_SIZE, Image.Resampling.BILINEAR))


@pytest.fixture(scope="module")
def png(photo: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photo).save(buf, format="PNG")  # lossless: the server sees `photo`
    return buf.getvalue()


def serve(checkpoint: Path, **overrides: object) -> LiveServer:
    return LiveServer(
        small_settings(sam_model=MODEL, sam_checkpoint=checkpoint, enable_swin=False, **overrides)
    ).start()


@pytest.fixture(scope="module")
def http(checkpoint: Path) -> Iterator[httpx.Client]:
    server = serve(checkpoint)
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c
    server.stop()


def everything(http: httpx.Client, png: bytes, **fields: Any) -> httpx.Response:
    files = {"image": ("dog.png", png, "image/png")}
    return http.post("/v1/segment/everything", files=files, data={"request": json.dumps(fields)})


def direct(model: Sam2, photo: np.ndarray, **fields: Any) -> AutomaticMasks:
    generator = Sam2AutomaticMaskGenerator(model, Sam2AutomaticMaskSettings(**fields))
    return generator.generate(torch.from_numpy(photo))


def served_masks(body: dict[str, Any]) -> torch.Tensor:
    return torch.from_numpy(
        np.stack([
            mask_utils.decode({"size": m["segmentation"]["size"],
                               "counts": m["segmentation"]["counts"].encode()})
            for m in body["masks"]
        ]).astype(bool)
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_served_masks_equal_the_generator(
    case: str, http: httpx.Client, model: Sam2, photo: np.ndarray, png: bytes
) -> None:
    fields = {**REQUEST, **CASES[case]}
    r = everything(http, png, **fields)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == PHOTO_SIZE
    assert body["model"]["name"] == MODEL
    expected = direct(model, photo, **fields)
    assert len(expected) >= 5, "too few masks to prove anything"
    assert len(body["masks"]) == len(expected)

    masks = served_masks(body)
    inter = (masks.flatten(1)[:, None] & expected.masks.flatten(1)[None]).sum(-1)
    union = (masks.flatten(1)[:, None] | expected.masks.flatten(1)[None]).sum(-1)
    best, match = (inter / union.clamp(min=1)).max(dim=1)
    assert float(best.min()) >= MIN_IOU
    assert sorted(match.tolist()) == list(range(len(expected)))  # one to one
    scores = [m["score"] for m in body["masks"]]
    np.testing.assert_allclose(scores, expected.scores.numpy(), atol=1e-4)
    stability = [m["stability_score"] for m in body["masks"]]
    np.testing.assert_allclose(stability, expected.stability.numpy(), atol=1e-3)
    assert [m["area"] for m in body["masks"]] == masks.flatten(1).sum(-1).tolist()
    if case == "crops":
        assert len({tuple(m["crop_box"]) for m in body["masks"]}) > 1
    if case == "defaults":  # served with SAM 2's pred_iou_thresh (0.8): SAM's drops some
        assert len(direct(model, photo, **fields, pred_iou_thresh=0.88)) < len(expected)
        assert min(scores) < 0.88


def test_a_field_sam2_does_not_support_is_a_clear_422(http: httpx.Client, png: bytes) -> None:
    r = everything(http, png, **REQUEST, min_mask_region_area=100)
    assert_error(r, 422, "invalid_request")
    assert "min_mask_region_area" in r.json()["error"]["message"]
    r = http.post("/v1/segment/everything", json={"image_id": "0" * 32, "mask_threshold": "x"})
    assert_error(r, 422, "invalid_request")
    assert everything(http, png, **REQUEST, min_mask_region_area=0).status_code == 200


def test_the_memory_bound_refuses_before_running(checkpoint: Path, png: bytes) -> None:
    server = serve(checkpoint, everything_max_bytes=1024)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert_error(everything(http, png, **REQUEST), 413, "everything_too_large")
    finally:
        server.stop()


def test_the_warm_up_compiles_the_measure_kernels_where_they_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Sam2Stages.warm_everything` compiles the generator's measure and paint kernels
    (`warm_kernels`) where they run, so the first request after start does not (1.2 s on
    the H100)."""
    calls: list[tuple[int, torch.dtype, str]] = []

    def record(m: int, dtype: torch.dtype, device: torch.device) -> None:
        calls.append((m, dtype, device.type))

    monkeypatch.setattr(stages_module, "warm_kernels", record)
    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None)
    stages = Sam2Stages(model, torch.device("cpu"), OptimizeOptions(), [1], [1])
    stages.warm_everything(4)
    assert calls == []  # the CPU without the interpreter: the generator measures unfused
    monkeypatch.setattr(stages_module, "runs_triton", lambda device: True)
    stages.warm_everything(4)
    assert calls == [(4 * model.config.embedding_size, torch.float32, "cpu")]
