"""Synthetic SAM weights (models/sam/synthesize.py): the shapes they learn, how well held-out
prompts reach them, and that the file is Meta's format, labelled by its sidecar alone.

The weights are trained once per session (tests/conftest.py, `synthetic_checkpoint`) on
generated photo-like pictures, vit_tiny on the CPU.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from segment_anything import SamPredictor

from models.provenance import read_provenance, sidecar_path, weights_label
from models.sam import SAM_CONFIGS, PromptSet, load_sam, pack_prompts
from models.sam.shapes import DISC_FRACTION, KINDS, ShapePrompts, sample_prompts, shape_masks
from models.sam.synthesize import SynthesisOptions, synthesize
from models.sam.transforms import postprocess_masks, preprocess_images
from models.weights import main as weights_main
from tests.conftest import SYNTHETIC_TIMEOUT_S, photo_like_array
from tests.reference_sam import build_reference_sam

TINY = SAM_CONFIGS["vit_tiny"]
# Floors a margin below what SYNTHETIC_TEST_STEPS x SYNTHETIC_TEST_BATCH (250 x 8) measured on
# held-out prompts here (2026-11-23, 2 cores): point 0.75 (min 0.69), pair 0.46, box_point
# 0.32, box 0.30; IoU-head error 0.07-0.14. Random weights give about 0. Discs come first;
# boxes need many more steps (the corners only reach the image tokens through attention),
# which the GPU runs of the released sizes take.
MIN_HELDOUT_IOU = {"point": 0.6, "pair": 0.3, "box_point": 0.25, "box": 0.2}
MAX_IOU_HEAD_ERROR = 0.25


def one(
    box: tuple[float, float, float, float] | None = None,
    points: tuple[tuple[float, float], ...] = (),
    labels: tuple[int, ...] = (),
) -> ShapePrompts:
    pts = torch.zeros(1, 2, 2)
    lab = torch.full((1, 2), -1, dtype=torch.int64)
    for k, (xy, label) in enumerate(zip(points, labels, strict=True)):
        pts[0, k] = torch.tensor(xy)
        lab[0, k] = label
    boxes = torch.tensor([box if box is not None else (0.0, 0.0, 0.0, 0.0)])
    return ShapePrompts(boxes, torch.tensor([box is not None]), pts, lab, torch.zeros(1))


def draw(prompt: ShapePrompts, size: int = 256, sizes: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    grid = torch.arange(size, dtype=torch.float32)
    return shape_masks(prompt, grid, grid, size, sizes)[0]


def test_a_point_names_a_disc_and_a_background_point_cuts_it() -> None:
    radius = DISC_FRACTION * 256
    disc = draw(one(points=((128, 128),), labels=(1,)))[0]
    assert disc.sum().item() == pytest.approx(math.pi * radius**2, rel=0.02)
    assert (
        disc[128, 128] and disc[128, int(128 + radius) - 1] and not disc[128, int(128 + radius) + 1]
    )
    pair = draw(one(points=((128, 128), (160, 128)), labels=(1, 0)))[0]
    assert not pair[128, 160] and pair[128, 100] and pair.sum() < disc.sum()
    # three sizes for the multimask outputs: nested, the middle one the shape itself
    small, same, large = draw(one(points=((128, 128),), labels=(1,)), sizes=(0.5, 1.0, 1.5))
    assert torch.equal(same, disc) and (small <= same).all() and (same <= large).all()


def test_a_box_names_its_region_with_rounded_corners() -> None:
    mask = draw(one(box=(40, 60, 200, 140)))[0]  # 160 x 80: corner radius 20
    assert mask[100, 120] and mask[60, 120] and mask[100, 40] and mask[100, 200]
    assert not mask[60, 40] and not mask[61, 41]  # the corner is cut
    assert not mask[59, 120] and not mask[100, 201]
    area = 161 * 81 - (4 - math.pi) * 20**2
    assert mask.sum().item() == pytest.approx(area, rel=0.02)
    with_hole = draw(one(box=(40, 60, 200, 140), points=((120, 100),), labels=(0,)))[0]
    assert not with_hole[100, 120] and with_hole[62, 120]


def test_a_box_with_points_stays_inside_the_box_and_a_hole_never_erases_it() -> None:
    box = (40, 60, 200, 140)
    region = draw(one(box=box))[0]
    # a foreground point names the box's object: its disc adds nothing beyond the box
    assert torch.equal(draw(one(box=box, points=((60, 70),), labels=(1,)))[0], region)
    # a background point's hole is capped at a quarter of the box's shorter side (80 / 4),
    # below the disc's radius (256 / 8): the box's ends stay
    hole = draw(one(box=box, points=((120, 100),), labels=(0,)))[0]
    assert not hole[100, 120 + 19] and hole[100, 120 + 21] and (hole <= region).all()
    small = draw(one(box=(100, 100, 132, 132), points=((116, 116),), labels=(0,)))[0]
    assert 0.4 * draw(one(box=(100, 100, 132, 132)))[0].sum() < small.sum()
    # without a box, the disc keeps its full radius
    pair = draw(one(points=((120, 100), (120, 160)), labels=(1, 0)))[0]
    assert pair[100, 120] and pair[127, 120] and not pair[131, 120]  # 33 and 29 from (120, 160)


def test_sampled_prompts_lie_in_the_image_and_cover_every_kind() -> None:
    sizes = torch.tensor([[192, 256]] * 400)
    prompts = sample_prompts(400, sizes, 256, torch.Generator().manual_seed(0))
    assert set(prompts.kind.tolist()) == set(range(len(KINDS)))
    boxes = prompts.boxes[prompts.has_box]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 256).all() and (boxes[:, 3] <= 192).all()
    present = prompts.labels >= 0
    xy = prompts.points[present]
    assert (xy >= 0).all() and (xy[:, 0] <= 255).all() and (xy[:, 1] <= 191).all()
    for k, name in enumerate(KINDS):
        sets = [s for s, kind in zip(prompts.prompt_sets(), prompts.kind, strict=True) if kind == k]
        with_box = {s.box is not None for s in sets}
        assert with_box == {name.startswith("box")}, name
    earlier = prompts.without_last_point()
    pair = prompts.kind == KINDS.index("pair")
    assert (earlier.labels[pair, 1] == -1).all() and (earlier.labels[pair, 0] == 1).all()


@pytest.mark.timeout(SYNTHETIC_TIMEOUT_S)
def test_heldout_prompts_reach_their_shapes(synthetic_checkpoint) -> None:
    _, report = synthetic_checkpoint
    assert set(report.heldout_iou) == set(KINDS)
    for kind in KINDS:
        assert report.heldout_iou[kind] >= MIN_HELDOUT_IOU[kind], report
        assert report.iou_head_error[kind] <= MAX_IOU_HEAD_ERROR, report


def test_file_loads_through_load_sam_and_is_labelled_synthetic(
    synthetic_checkpoint, generated_photo_dir: Path
) -> None:
    path, report = synthetic_checkpoint
    assert weights_label(path) == "synthetic"
    record = read_provenance(path)
    assert record is not None and record["model"] == "vit_tiny"
    assert record["training"]["heldout_iou"] == report.heldout_iou
    assert "shapes, not objects" in record["statement"]
    assert set(torch.load(path, weights_only=True)) == set(load_sam(TINY, None).state_dict())
    model = load_sam(TINY, path)  # strict keys and shapes
    # a point on a photo-like picture: the mask is its disc, the score in [0, 1]
    image = torch.from_numpy(photo_like_array(192, 256, seed=9))
    batch, _ = preprocess_images([image], TINY, "cpu")
    point = PromptSet(points=[[120.0, 90.0]], labels=[1])
    with torch.inference_mode():
        low, iou = model.decode(model.encode(batch), pack_prompts([point], [0], "cpu"))
    got = F.interpolate(low[:, :1], (256, 256), mode="bilinear")[0, 0, :192] > 0
    want = draw(one(points=((120.0, 90.0),), labels=(1,)))[0, :192]
    assert _iou(got, want) >= MIN_HELDOUT_IOU["point"]
    assert 0.0 <= float(iou[0, 0]) <= 1.0


def test_scores_rank_a_half_size_disc_below_the_exact_one(synthetic_checkpoint) -> None:
    """Every output's score estimates its IoU with the size-1 shape (the object named), so
    the 0.5x multimask output (IoU <= 0.25 with it) scores below the size-1 output and is
    never the top one. Scored against their own sizes, as before, all three predicted ~1
    and the service's best-first sort meant nothing. Measured: 30 of 30 points (mean scores
    0.47, 0.72, 0.65 for 0.5x, 1x, 1.5x; 1x against 1.5x is not yet reliable after 250 CPU
    steps, so the GPU run's report counts how often the top one is 1x,
    `multimask_top_exact`)."""
    path, _ = synthetic_checkpoint
    model = load_sam(TINY, path)
    image = torch.from_numpy(photo_like_array(192, 256, seed=9))
    batch, _ = preprocess_images([image], TINY, "cpu")
    points = [[40.0 + 30 * i, 40.0 + 25 * j] for i in range(6) for j in range(5)]
    sets = [PromptSet(points=[xy], labels=[1]) for xy in points]
    with torch.inference_mode():
        emb = model.encode(batch).expand(len(sets), -1, -1, -1)
        _, scores = model.decode(emb, pack_prompts(sets, None, "cpu"))
    assert ((scores >= 0) & (scores <= 1)).all(), scores
    half, exact = scores[:, 1], scores[:, 2]  # multimask sizes 0.5, 1.0, 1.5
    assert (half < exact).float().mean() >= 0.9, scores
    assert (scores[:, 1:].argmax(1) != 0).all(), scores


def test_meta_segment_anything_loads_the_file_and_draws_the_shape(synthetic_checkpoint) -> None:
    path, _ = synthetic_checkpoint
    reference = build_reference_sam(TINY)
    reference.load_state_dict(torch.load(path, weights_only=True), strict=True)
    predictor = SamPredictor(reference)
    image = torch.from_numpy(photo_like_array(192, 256, seed=11))  # already long side 256
    predictor.set_torch_image(image.permute(2, 0, 1)[None].float(), (192, 256))
    point = np.array([[100.0, 80.0]])
    masks, scores, _ = predictor.predict(point_coords=point, point_labels=np.array([1]),
                                         multimask_output=False)  # fmt: skip
    want = draw(one(points=((100.0, 80.0),), labels=(1,)))[0, :192]
    assert _iou(torch.from_numpy(masks[0]), want) >= MIN_HELDOUT_IOU["point"]
    assert 0.0 <= float(scores[0]) <= 1.0
    # and the same masks as our model gives through its own loading path
    ours = load_sam(TINY, path)
    batch, _ = preprocess_images([image], TINY, "cpu")
    with torch.inference_mode():
        low, iou = ours.decode(
            ours.encode(batch), pack_prompts([PromptSet(points=point, labels=[1])], [0], "cpu")
        )
    logits = postprocess_masks(low[:, :1], (192, 256), (192, 256), TINY)[0, 0] > 0
    agree = _iou(logits, torch.from_numpy(masks[0]))
    assert agree >= 0.99 and float(iou[0, 0]) == pytest.approx(float(scores[0]), abs=1e-4)


def test_a_stale_or_missing_sidecar_never_says_synthetic(synthetic_checkpoint, tmp_path) -> None:
    path, _ = synthetic_checkpoint
    assert weights_label(None) == "random"
    copy = tmp_path / "renamed.pth"
    shutil.copy(path, copy)
    assert weights_label(copy) == "renamed.pth"  # no sidecar: named by its file
    shutil.copy(sidecar_path(path), sidecar_path(copy))
    assert weights_label(copy) == "synthetic"  # moved together: still what it was
    state = torch.load(copy, weights_only=True)
    state["mask_decoder.iou_token.weight"] += 1
    torch.save(state, copy)  # edited after the sidecar was written
    assert weights_label(copy) == "renamed.pth"
    assert load_sam(TINY, copy) is not None  # and it loads like any checkpoint
    sidecar_path(copy).write_text("{not json")
    assert weights_label(copy) == "renamed.pth"
    sidecar_path(copy).write_text(json.dumps({"weights": "synthetic"}))  # no hash
    assert weights_label(copy) == "renamed.pth"


def test_seeded_synthesis_is_deterministic_on_the_cpu(generated_photo_dir: Path) -> None:
    from models.fidelity import load_photos

    photos = load_photos(generated_photo_dir)
    options = SynthesisOptions(steps=3, batch_size=4, crops=4, heldout_crops=2, heldout_prompts=2)
    first, a = synthesize(TINY, photos, options, torch.device("cpu"))
    second, b = synthesize(TINY, photos, options, torch.device("cpu"))
    for (name, x), (_, y) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
    assert a.heldout_iou == b.heldout_iou
    # only the prompt encoder and the mask decoder were trained
    untouched = load_sam(TINY, None, seed=options.seed).state_dict()
    for name, value in first.state_dict().items():
        changed = not torch.equal(value, untouched[name])
        assert changed == (not name.startswith("image_encoder.")) or "pe_layer" in name, name


def test_cli_writes_the_file_and_keeps_it(generated_photo_dir: Path, tmp_path, capsys) -> None:
    args = ["synthesize", "vit_tiny", "--dest", str(tmp_path), "--images", str(generated_photo_dir)]
    assert weights_main([*args, "--steps", "2", "--batch-size", "4", "--crops", "4"]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "sam_vit_tiny_synthetic.pth"
    assert str(path) in out and all(kind in out for kind in KINDS)
    assert weights_label(path) == "synthetic"
    stamp = path.stat().st_mtime_ns
    assert weights_main(args) == 0  # there already, with its sidecar: not trained again
    assert path.stat().st_mtime_ns == stamp
    assert weights_main(["synthesize", "vit_q", "--dest", str(tmp_path)]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        weights_main(["synthesize", "vit_tiny", "--dest", str(empty), "--images", str(empty)]) == 2
    )


def _iou(a: torch.Tensor, b: torch.Tensor) -> float:
    union = (a | b).sum().item()
    return (a & b).sum().item() / union if union else 1.0
