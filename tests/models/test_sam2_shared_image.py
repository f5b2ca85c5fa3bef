"""`Sam2.share_image`: prompt sets on one image without mask inputs hand the decoder one
row of image tokens, broadcast until the first image-to-token attention. The arithmetic
is the same (each set's first-layer projections of identical rows), so the answers are
too, eager and through segment everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from models.sam2 import SAM2_CONFIGS, Sam2, load_sam2
from models.sam2.automatic import Sam2AutomaticMaskGenerator, Sam2AutomaticMaskSettings
from tests.conftest import PHOTOS


@pytest.fixture(scope="module")
def model() -> Sam2:
    torch.manual_seed(0)
    return load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None).eval()


def _decode(model: Sam2, share: bool, **prompts: torch.Tensor | bool) -> tuple[torch.Tensor, ...]:
    model.share_image = share
    try:
        with torch.inference_mode():
            features = model.encode(
                torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(1))
            )
            pred = model.decode(features, **prompts)  # type: ignore[arg-type]
    finally:
        model.share_image = False
    return pred.low_res_masks, pred.iou, pred.object_logits


@pytest.mark.parametrize("kind", ["clicks", "box_single_mask", "mask_input"])
def test_a_shared_image_row_gives_the_same_answers(model: Sam2, kind: str) -> None:
    g = torch.Generator().manual_seed(2)
    prompts: dict[str, torch.Tensor | bool] = {
        "points": torch.rand(5, 2, 2, generator=g) * 256,
        "labels": torch.tensor([[1, 0]] * 5),
        "multimask": kind == "clicks",
    }
    if kind == "box_single_mask":
        prompts["boxes"] = torch.tensor([[10.0, 20.0, 200.0, 180.0]]).expand(5, 4)
    if kind == "mask_input":  # each set's own dense prompt: the rows differ, none shared
        prompts["mask_input"] = torch.randn(5, 1, 64, 64, generator=g)
    plain_out, shared_out = _decode(model, False, **prompts), _decode(model, True, **prompts)
    for plain, shared in zip(plain_out, shared_out, strict=True):
        torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)


def test_segment_everything_with_a_shared_row(model: Sam2) -> None:
    """Eager here; compiled, with the fused attention reading the shared row in place, in
    tests/models/test_decoder_attention_kernel.py."""
    image = Image.open(PHOTOS / "dog.jpg").convert("RGB").resize((96, 64))
    photo = torch.from_numpy(np.array(image))
    settings = Sam2AutomaticMaskSettings(
        points_per_side=6, pred_iou_thresh=0.01, stability_score_thresh=0.5
    )
    plain = Sam2AutomaticMaskGenerator(model, settings).generate(photo)
    model.share_image = True
    try:
        shared = Sam2AutomaticMaskGenerator(model, settings).generate(photo)
    finally:
        model.share_image = False
    assert plain.masks.shape[0] >= 1
    torch.testing.assert_close(shared.scores, plain.scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(shared.boxes, plain.boxes)
    # a logit within rounding of the threshold may flip a pixel; the masks agree otherwise
    assert (shared.masks != plain.masks).float().mean() < 1e-4
