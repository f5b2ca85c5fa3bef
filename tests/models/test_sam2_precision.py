"""SAM 2 in bf16: the whole image path runs in the model's dtype (no fp32 level left behind
by the neck, positions computed in fp32 then cast), and its masks stay close to fp32's.

Random weights make this a loose check (IoU >= 0.9 per mask against fp32 on the same
weights); the tight parity with Meta is fp32's (test_sam2_parity.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.transforms import preprocess_image
from tests.conftest import PHOTOS

CONFIG = SAM2_CONFIGS["sam2_test_tiny"]


@pytest.mark.parametrize("prompt", ["click", "box and click", "click and mask"])
def test_bf16_runs_in_bf16_and_follows_fp32(prompt: str) -> None:
    with Image.open(PHOTOS / "dog.jpg") as image:
        photo = np.asarray(image.convert("RGB"))
    images = preprocess_image(photo, CONFIG)
    points, labels = torch.tensor([[[128.0, 100.0]]]), torch.tensor([[1]])
    boxes = torch.tensor([[40.0, 30.0, 220.0, 200.0]]) if "box" in prompt else None
    gen = torch.Generator().manual_seed(0)
    mask = torch.randn(1, 1, 64, 64, generator=gen) * 4 if "mask" in prompt else None
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_sam2(CONFIG, None, seed=5).to(dtype)
        with torch.no_grad():
            features = model.encode(images)
            assert features.image_embed.dtype == dtype
            assert all(t.dtype == dtype for t in features.high_res)
            prediction = model.decode(features, points, labels, boxes, mask)
        assert prediction.low_res_masks.dtype == dtype
        results.append(prediction.low_res_masks.float() > 0)
    full, half = results
    assert 0.01 < full.float().mean() < 0.99
    iou = (full & half).sum((2, 3)) / (full | half).sum((2, 3))
    assert bool((iou >= 0.9).all()), iou
