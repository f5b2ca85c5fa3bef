"""SAM 2 decoding of many requests' prompts in one call (`Sam2.decode_batch` on SAM's
`pack_prompts` batch): every set's answer equals Meta's `SAM2ImagePredictor.predict` for
that set alone on its own image, with clicks, boxes, box plus click, mask inputs and a mask
alone mixed across two photos of different sizes (fp32, random weights as in the parity
tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from models.sam import PromptSet, pack_prompts
from models.sam2 import SAM2_CONFIGS, Sam2, Sam2Config, Sam2Features, load_sam2
from models.sam2.mask_decoder import select_masks
from models.sam2.transforms import postprocess_masks, preprocess_image, scale_boxes, scale_points
from tests.models.sam2_reference import build_reference_sam2, randomize, save_official

CONFIG: Sam2Config = SAM2_CONFIGS["sam2_test_tiny"]


@dataclass(frozen=True)
class Request:
    """One request's prompt, in its photo's pixels."""

    image: int
    points: list[list[float]] | None = None
    labels: list[int] | None = None
    box: list[float] | None = None
    with_mask: bool = False
    multimask: bool = True


REQUESTS = [
    Request(0, [[60.0, 70.0]], [1]),
    Request(1, box=[20.0, 30.0, 150.0, 110.0], multimask=False),
    Request(0, [[120.0, 90.0]], [0], box=[30.0, 20.0, 170.0, 120.0]),
    Request(1, [[40.0, 50.0], [100.0, 80.0]], [1, 0], multimask=False),
    Request(0, [[60.0, 70.0]], [1], with_mask=True, multimask=False),
    Request(1, with_mask=True, multimask=False),
]


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, small_photo_dir: Path
) -> tuple[list[Any], Sam2, list[np.ndarray]]:
    """Meta's predictors (one per photo, image set), our model and the two photos."""
    from sam2.sam2_image_predictor import SAM2ImagePredictor

    reference = build_reference_sam2(CONFIG, override_sizes=True)
    randomize(reference, seed=99)
    ours = load_sam2(CONFIG, save_official(reference, tmp_path_factory.mktemp("b") / "t.pt"))
    photos = []
    for name in ("dog.jpg", "truck.png"):
        with Image.open(small_photo_dir / name) as image:
            photos.append(np.asarray(image.convert("RGB")))
    assert photos[0].shape != photos[1].shape
    e = CONFIG.embedding_size
    predictors = []
    for photo in photos:
        predictor = SAM2ImagePredictor(reference)
        predictor._bb_feat_sizes = [(4 * e, 4 * e), (2 * e, 2 * e), (e, e)]  # 256-px input
        predictor.set_image(photo)
        predictors.append(predictor)
    return predictors, ours, photos


def _previous_logits(predictor: Any) -> np.ndarray:
    """A refinement round's input: the best low-res logits of a first click, `[1, 4h, 4w]`."""
    _, scores, logits = predictor.predict(np.array([[60.0, 70.0]]), np.array([1]))
    return logits[np.argmax(scores)][None]


def test_mixed_batch_matches_image_predictor_per_request(
    setup: tuple[list[Any], Sam2, list[np.ndarray]],
) -> None:
    predictors, ours, photos = setup
    sizes = [(p.shape[0], p.shape[1]) for p in photos]
    sets: list[PromptSet] = []
    expected = []
    for r in REQUESTS:
        hw = sizes[r.image]
        previous = _previous_logits(predictors[r.image]) if r.with_mask else None
        expected.append(
            predictors[r.image].predict(
                point_coords=None if r.points is None else np.array(r.points),
                point_labels=None if r.labels is None else np.array(r.labels),
                box=None if r.box is None else np.array(r.box, dtype=np.float32),
                mask_input=previous,
                multimask_output=r.multimask,
            )
        )
        sets.append(
            PromptSet(
                points=() if r.points is None else scale_points(torch.tensor(r.points), hw, CONFIG),
                labels=() if r.labels is None else r.labels,
                box=None if r.box is None else scale_boxes(torch.tensor([r.box]), hw, CONFIG)[0],
                mask_input=None if previous is None else torch.from_numpy(previous),
            )
        )

    with torch.no_grad():
        encoded = [ours.encode(preprocess_image(p, CONFIG)) for p in photos]
        features = Sam2Features(
            torch.cat([f.image_embed for f in encoded]),
            (
                torch.cat([f.high_res[0] for f in encoded]),
                torch.cat([f.high_res[1] for f in encoded]),
            ),
        )
        batch = pack_prompts(sets, [r.image for r in REQUESTS], "cpu")
        masks, iou, _ = ours.decode_batch(features, batch)

    for p, (r, (their_masks, their_scores, their_low)) in enumerate(
        zip(REQUESTS, expected, strict=True)
    ):
        low, scores = select_masks(
            masks[p : p + 1], iou[p : p + 1], r.multimask, CONFIG.stability_delta,
            CONFIG.stability_thresh,
        )  # fmt: skip
        our_masks, our_low = postprocess_masks(low, sizes[r.image], CONFIG)
        their_low_t = torch.from_numpy(their_low).reshape(our_low.shape)
        rel = float((our_low - their_low_t).norm() / their_low_t.norm())
        assert rel < 1e-4, (p, rel)
        assert np.allclose(scores[0].numpy(), their_scores, atol=1e-5), p
        theirs = their_masks.reshape(our_masks.shape[1:]).astype(bool)
        for m in range(theirs.shape[0]):
            a, b = our_masks[0, m].numpy(), theirs[m]
            assert 0.01 < b.mean() < 0.99, (p, m, "degenerate mask")
            assert (a & b).sum() / (a | b).sum() >= 0.98, (p, m)


def test_features_one_row_per_set(setup: tuple[list[Any], Sam2, list[np.ndarray]]) -> None:
    """Without image_index the features are used row for row; a count mismatch is refused."""
    _, ours, photos = setup
    with torch.no_grad():
        f = ours.encode(preprocess_image(photos[0], CONFIG))
        sets = [PromptSet(points=[[10.0, 20.0]], labels=[1]), PromptSet(box=[5, 5, 80, 90])]
        gathered = ours.decode_batch(f, pack_prompts(sets, [0, 0], "cpu"))
        rows = Sam2Features(
            f.image_embed.expand(2, -1, -1, -1),
            (f.high_res[0].expand(2, -1, -1, -1), f.high_res[1].expand(2, -1, -1, -1)),
        )
        direct = ours.decode_batch(rows, pack_prompts(sets, None, "cpu"))
        assert all(torch.equal(a, b) for a, b in zip(gathered, direct, strict=True))
        with pytest.raises(ValueError, match="one image per prompt set: 1 images for 2 sets"):
            ours.decode_batch(f, pack_prompts(sets, None, "cpu"))
