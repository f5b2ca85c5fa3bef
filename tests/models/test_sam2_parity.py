"""Parity of `models.sam2` with Meta's `sam2` package on the same random weights.

Meta's model is built by its own `build_sam2` from its shipped yaml (the test config only
shrinks the trunk and the input), randomised, saved in the official `{"model": ...}`
format and loaded into ours. Meta runs through `SAM2ImagePredictor` (set_image, predict);
ours through `preprocess_image`, `Sam2.encode`, `Sam2.decode` and `postprocess_masks`.
fp32 features and logits agree to a relative error below 1e-4, masks to IoU >= 0.98.

Meta's package is a test-only dependency installed without its dependencies (they would
pull torch and torchvision); CI and the README install it with the same line:
`SAM2_BUILD_CUDA=0 pip install --no-deps --no-build-isolation sam2==1.1.0`
(`--no-build-isolation` because its build requirements name torch: the torch already
installed is used instead of a second download). hydra-core and iopath come from the dev
extra; torchvision is the test-only stand-in in tests/_stubs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from models.fidelity import FidelityPrompt, eager_sam2_runner, fidelity_prompts
from models.sam2 import SAM2_CONFIGS, Sam2, Sam2Config, Sam2Features, load_sam2
from models.sam2.mask_decoder import select_masks
from models.sam2.transforms import postprocess_masks, preprocess_image, scale_boxes, scale_points
from tests.models.sam2_reference import build_reference_sam2, randomize, save_official

TOL = 1e-4


def _rel(ours: Tensor, theirs: Tensor) -> float:
    theirs = theirs.float()
    return float((ours.float() - theirs).norm() / theirs.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def config() -> Sam2Config:
    return SAM2_CONFIGS["sam2_test_tiny"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, config: Sam2Config) -> tuple[Any, Sam2]:
    """(Meta's SAM2Base, ours loaded from its official-format checkpoint)."""
    reference = build_reference_sam2(config, override_sizes=True)
    randomize(reference, seed=1234)
    path = save_official(reference, tmp_path_factory.mktemp("sam2") / "sam2_tiny_random.pt")
    return reference, load_sam2(config, path)


@pytest.fixture(scope="module")
def photo(small_photo_dir: Path) -> np.ndarray:
    """A real, non-square photo (the resize to the square input stretches it)."""
    with Image.open(small_photo_dir / "dog.jpg") as image:
        return np.asarray(image.convert("RGB"))


def _predictor(reference: Any, config: Sam2Config) -> Any:
    from sam2.sam2_image_predictor import SAM2ImagePredictor

    predictor = SAM2ImagePredictor(reference)
    # Meta hard-codes the feature sizes of its 1024-px input; these are the test config's
    e = config.embedding_size
    predictor._bb_feat_sizes = [(4 * e, 4 * e), (2 * e, 2 * e), (e, e)]
    return predictor


@pytest.fixture(scope="module")
def encoded(
    models: tuple[Any, Sam2], config: Sam2Config, photo: np.ndarray
) -> tuple[Any, Sam2Features]:
    """Meta's predictor with the photo set, and our features of the same photo."""
    reference, ours = models
    predictor = _predictor(reference, config)
    predictor.set_image(photo)
    with torch.no_grad():
        features = ours.encode(preprocess_image(photo, config))
    return predictor, features


def test_preprocessing_matches(config: Sam2Config, photo: np.ndarray) -> None:
    from sam2.utils.transforms import SAM2Transforms

    theirs = SAM2Transforms(config.image_size, mask_threshold=0.0)(photo)
    ours = preprocess_image(photo, config)
    assert ours.shape == (1, 3, config.image_size, config.image_size)
    assert _rel(ours[0], theirs) < 1e-6


def test_encoder_levels_match(models: tuple[Any, Sam2], config: Sam2Config) -> None:
    """Neck features and sine position encodings of every kept level, on a batch of 2."""
    reference, ours = models
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(2, 3, config.image_size, config.image_size, generator=gen)
    with torch.no_grad():
        theirs = reference.image_encoder(images)
        mine = ours.image_encoder(images)
    assert len(mine.features) == len(theirs["backbone_fpn"]) == 3
    for level, (a, b) in enumerate(zip(mine.features, theirs["backbone_fpn"], strict=True)):
        assert a.shape == b.shape, level
        assert _rel(a, b) < TOL, level
    for a, b in zip(mine.pos, theirs["vision_pos_enc"], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_image_embedding_and_high_res_features_match(
    encoded: tuple[Any, Sam2Features], config: Sam2Config
) -> None:
    predictor, features = encoded
    e = config.embedding_size
    assert features.image_embed.shape == (1, config.d_model, e, e)
    assert _rel(features.image_embed, predictor._features["image_embed"]) < TOL
    theirs = predictor._features["high_res_feats"]
    for ours, meta, side in zip(features.high_res, theirs, (4 * e, 2 * e), strict=True):
        assert ours.shape == meta.shape and ours.shape[-1] == side
        assert _rel(ours, meta) < TOL


@dataclass(frozen=True)
class Case:
    """One `SAM2ImagePredictor.predict` call, in original-image pixels."""

    name: str
    points: list[list[float]] | None = None
    labels: list[int] | None = None
    boxes: list[list[float]] | None = None
    with_mask: bool = False
    multimask: bool = True


CASES = [
    Case("one click, multimask", [[60.0, 70.0]], [1]),
    Case(
        "two clicks, single mask (stability fallback)",
        [[60.0, 70.0], [150.0, 40.0]],
        [1, 0],
        multimask=False,
    ),
    Case("box", boxes=[[30.0, 20.0, 170.0, 120.0]], multimask=False),
    Case("box and click", [[120.0, 90.0]], [0], boxes=[[30.0, 20.0, 170.0, 120.0]]),
    Case("click with the previous mask", [[60.0, 70.0]], [1], with_mask=True, multimask=False),
    Case("previous mask alone", with_mask=True, multimask=False),
    Case("three boxes at once", boxes=[[10, 10, 90, 90], [50, 30, 190, 130], [0, 0, 60, 140]]),
]


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    # empty or full masks would agree whatever the models computed
    assert 0.01 < b.mean() < 0.99, "degenerate mask"
    return float(np.logical_and(a, b).sum() / union)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_masks_match_image_predictor(
    case: Case,
    encoded: tuple[Any, Sam2Features],
    models: tuple[Any, Sam2],
    config: Sam2Config,
    photo: np.ndarray,
) -> None:
    predictor, features = encoded
    ours = models[1]
    hw = (photo.shape[0], photo.shape[1])
    previous = None
    if case.with_mask:  # a refinement round: the low-res logits of a first click
        _, scores, logits = predictor.predict(np.array([[60.0, 70.0]]), np.array([1]))
        previous = logits[np.argmax(scores)][None]  # [1, 4h, 4w]
    masks, scores, low_res = predictor.predict(
        point_coords=None if case.points is None else np.array(case.points),
        point_labels=None if case.labels is None else np.array(case.labels),
        box=None if case.boxes is None else np.array(case.boxes, dtype=np.float32),
        mask_input=previous,
        multimask_output=case.multimask,
    )

    sets = 1 if case.boxes is None else len(case.boxes)
    points = labels = boxes = mask_input = None
    if case.points is not None and case.labels is not None:
        points = scale_points(torch.tensor(case.points).expand(sets, -1, -1), hw, config)
        labels = torch.tensor(case.labels).expand(sets, -1)
    if case.boxes is not None:
        boxes = scale_boxes(torch.tensor(case.boxes, dtype=torch.float32), hw, config)
    if previous is not None:
        mask_input = torch.from_numpy(previous)[None].expand(sets, -1, -1, -1)
    with torch.no_grad():
        prediction = ours.decode(features, points, labels, boxes, mask_input, case.multimask)
    our_masks, our_low_res = postprocess_masks(prediction.low_res_masks, hw, config)

    # Meta squeezes a batch of one away
    masks = masks.reshape(sets, -1, *hw).astype(bool)
    scores = scores.reshape(sets, -1)
    low_res = low_res.reshape(sets, -1, *low_res.shape[-2:])
    assert our_masks.shape == masks.shape
    assert masks.shape[1] == (3 if case.multimask else 1)
    assert _rel(our_low_res, torch.from_numpy(low_res)) < TOL
    assert np.allclose(prediction.iou.numpy(), scores, atol=1e-5)
    for k in range(sets):
        for m in range(masks.shape[1]):
            assert _iou(our_masks[k, m].numpy(), masks[k, m]) >= 0.98, (k, m)


def test_the_fidelity_reference_is_the_image_predictor(
    encoded: tuple[Any, Sam2Features],
    models: tuple[Any, Sam2],
    config: Sam2Config,
    photo: np.ndarray,
) -> None:
    """`eager_sam2_runner`, the start-up fidelity check's reference, answers each of its
    prompts as `predict` does: column 0 as a single-mask call (the stability fallback where
    token 0 is unstable, which the two clicks of CASES need), columns 1-3 as a multimask
    call."""
    predictor = encoded[0]
    hw = (photo.shape[0], photo.shape[1])
    prompts = [
        *fidelity_prompts(*hw),
        FidelityPrompt(points=((60.0, 70.0), (150.0, 40.0)), labels=(1, 0)),
    ]
    out = eager_sam2_runner(models[1], torch.device("cpu"))(torch.from_numpy(photo.copy()), prompts)
    assert tuple(out.masks.shape) == (len(prompts), 4, *hw) and out.masks.dtype == torch.bool
    fallbacks = 0
    for k, p in enumerate(prompts):
        answers = [
            predictor.predict(
                point_coords=np.array(p.points) if p.points else None,
                point_labels=np.array(p.labels) if p.points else None,
                box=None if p.box is None else np.array(p.box, dtype=np.float32),
                multimask_output=multimask,
            )
            for multimask in (False, True)
        ]
        masks = np.concatenate([a[0] for a in answers]).astype(bool)  # [4, H, W]
        scores = np.concatenate([a[1] for a in answers])
        assert np.allclose(out.scores[k].numpy(), scores, atol=1e-5), p
        for m in range(4):
            assert _iou(out.masks[k, m].numpy(), masks[m]) >= 0.98, (p, m)
        fallbacks += bool((scores[0] == scores[1:]).any())  # the candidate's own score
    assert fallbacks > 0, "no prompt took the stability fallback"
    assert _rel(out.embedding, predictor._features["image_embed"][0]) < TOL


def test_single_mask_selection_matches(models: tuple[Any, Sam2], config: Sam2Config) -> None:
    """Stable rows keep token 0, unstable ones take the best multimask candidate: Meta's
    rule on logits built to be stable or not (random weights are always unstable)."""
    decoder = models[0].sam_mask_decoder
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4, 16, 16, generator=gen) * 5
    logits[0, 0] = 10.0  # far from the threshold: stable
    logits[1, 0] = -10.0  # empty on both sides: stable by Meta's convention
    logits[2, 0, :8] = 10.0
    logits[2, 0, 8:] = -10.0  # a crisp half: stable
    iou = torch.rand(4, 4, generator=gen)
    theirs = decoder._dynamic_multimask_via_stability(logits, iou)
    ours = select_masks(logits, iou, False, config.stability_delta, config.stability_thresh)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[0][:3], logits[:3, :1])  # the stable rows kept token 0
    assert not torch.equal(ours[0][3], logits[3, 0:1])  # the noisy row did not


def test_hiera_tiny_at_1024_matches(tmp_path: Path, photo: np.ndarray) -> None:
    """A released size as shipped (Meta's yaml untouched, 1024 px): 14-wide windows pad the
    64x64 stage-3 map to 70x70, and the predictor's own feature sizes apply."""
    from sam2.sam2_image_predictor import SAM2ImagePredictor

    config = SAM2_CONFIGS["sam2.1_hiera_tiny"]
    reference = build_reference_sam2(config, override_sizes=False)
    randomize(reference, seed=7)
    ours = load_sam2(config, save_official(reference, tmp_path / "hiera_tiny.pt"))
    predictor = SAM2ImagePredictor(reference)
    predictor.set_image(photo)
    with torch.no_grad():
        features = ours.encode(preprocess_image(photo, config))
    assert features.image_embed.shape == (1, 256, 64, 64)
    assert _rel(features.image_embed, predictor._features["image_embed"]) < TOL
    for a, b in zip(features.high_res, predictor._features["high_res_feats"], strict=True):
        assert _rel(a, b) < TOL

    hw = (photo.shape[0], photo.shape[1])
    masks, scores, _ = predictor.predict(np.array([[60.0, 70.0]]), np.array([1]))
    with torch.no_grad():
        prediction = ours.decode(
            features, scale_points(torch.tensor([[[60.0, 70.0]]]), hw, config), torch.tensor([[1]])
        )
    our_masks, _ = postprocess_masks(prediction.low_res_masks, hw, config)
    assert np.allclose(prediction.iou[0].numpy(), scores, atol=1e-5)
    for m in range(3):
        assert _iou(our_masks[0, m].numpy(), masks[m].astype(bool)) >= 0.98, m


SAM2_INSTALL = "SAM2_BUILD_CUDA=0 pip install --no-deps --no-build-isolation sam2==1.1.0"


def test_ci_and_readme_install_meta_sam2_with_one_line() -> None:
    """The line quoted in this module's docstring is the one the README's test command and
    .ci/run run, and those two commands are the same."""
    root = Path(__file__).resolve().parents[2]
    readme = [ln for ln in (root / "README.md").read_text().splitlines() if "pytest -q" in ln]
    ci = [ln for ln in (root / ".ci" / "run").read_text().splitlines() if ln.startswith("apt-get")]
    assert readme[0] == ci[0]
    assert f"&& {SAM2_INSTALL} &&" in ci[0]
    assert SAM2_INSTALL in " ".join((__doc__ or "").split())
