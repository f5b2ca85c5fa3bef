"""Segment everything: parity with Meta's `SamAutomaticMaskGenerator`, and the ops under it.

The parity cases run Meta's generator and ours on the same weights, the same real photo and
the same settings, and match every mask of ours to a distinct mask of Meta's (IoU >= 0.99)
with the same scores, boxes, areas, prompts and crops. The ops (NMS, stability score,
mask -> box, connected components, small-region removal, grids and crop boxes) are checked
against brute-force references or Meta's own functions.
"""

from __future__ import annotations

import copy
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from segment_anything import SamAutomaticMaskGenerator
from segment_anything.utils import amg
from torch import Tensor

from models.sam import PromptSet, Sam, SamConfig, load_sam, pack_prompts
from models.sam.automatic import (
    AutomaticMaskGenerator,
    AutomaticMasks,
    AutomaticMaskSettings,
    MaskCandidates,
    estimate_peak_bytes,
    single_point_prompts,
)
from models.sam.automatic_ops import (
    batched_nms,
    connected_components,
    crop_boxes,
    masks_to_boxes,
    point_grid,
    remove_small_regions,
    stability_score,
)
from models.sam.transforms import resize_longest_side_size
from tests.conftest import PHOTOS

PHOTO_SIZE = (256, 171)  # (W, H): the long side is the tiny model's input, no resize needed
SHARPNESS = 100.0

PerCrop = list[list[MaskCandidates]]

# Settings under which the blob model (below) gives dozens of candidates that pass the
# filters, of which NMS removes most; each case is asserted not to be vacuous.
BASE: dict[str, Any] = {
    "points_per_side": 16,
    "pred_iou_thresh": 0.01,
    "stability_score_thresh": 0.6,
}
CASES: dict[str, dict[str, Any]] = {
    "full_image": {},
    "crops": {"crop_n_layers": 1, "crop_n_points_downscale_factor": 2, "crop_nms_thresh": 0.5},
    "small_regions": {"min_mask_region_area": 1000},
}


@pytest.fixture(scope="module")
def photo() -> Tensor:
    """dog.jpg, downscaled to 256x171: uint8 `[171, 256, 3]`."""
    path = PHOTOS / "dog.jpg"
    image = Image.open(path).convert("RGB").resize(PHOTO_SIZE, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.array(image))


@pytest.fixture(scope="module")
def blob_models(
    reference_sam: Any, tiny_config: SamConfig, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Sam]:
    """Meta's model and ours on the fixtures' random weights, changed to draw blobs.

    With plain random weights every mask is per-pixel noise over the whole image: every box
    is the image, NMS keeps one mask and the tests would prove little. Two changes, made to
    a copy of Meta's weights that ours then loads from an official-format file, give
    coherent masks: the decoder's two upscaling transposed convolutions get one weight for
    all four kernel taps (each embedding cell becomes a flat block instead of a random
    pattern), and the hypernetwork outputs are scaled up (sharper logits, so that some
    masks are stable).
    """
    reference = copy.deepcopy(reference_sam)
    with torch.no_grad():
        decoder = reference.mask_decoder
        for conv in (decoder.output_upscaling[0], decoder.output_upscaling[3]):
            conv.weight.copy_(conv.weight.mean(dim=(2, 3), keepdim=True).expand_as(conv.weight))
        for mlp in decoder.output_hypernetworks_mlps:
            mlp.layers[-1].weight.mul_(SHARPNESS)
            mlp.layers[-1].bias.mul_(SHARPNESS)
    path = tmp_path_factory.mktemp("sam_blobs") / "sam_vit_tiny_blobs.pth"
    torch.save(reference.state_dict(), path)
    return reference, load_sam(tiny_config, path)


@pytest.fixture(scope="module")
def ours(blob_models, photo: Tensor) -> Callable[[str], tuple[PerCrop, AutomaticMasks]]:
    """Our step-by-step run of a case (memoised: several tests look at the same runs)."""
    runs: dict[str, tuple[PerCrop, AutomaticMasks]] = {}

    def run(case: str) -> tuple[PerCrop, AutomaticMasks]:
        if case not in runs:
            settings = AutomaticMaskSettings(**BASE, **CASES[case])
            runs[case] = _steps(AutomaticMaskGenerator(blob_models[1], settings), photo)
        return runs[case]

    return run


def _float_resize_set_image(self: Any, image: np.ndarray, image_format: str = "RGB") -> None:
    """`SamPredictor.set_image` with our float resize instead of PIL's uint8 one.

    Meta resizes crops with PIL (rounding to uint8), ours on floats; that known difference
    (bounded in test_sam_transforms) flips a few masks of the randomly weighted model, so
    the reference is given the same resized pixels. The full image here needs no resize.
    """
    x = torch.as_tensor(image).permute(2, 0, 1)[None].float()
    h, w = image.shape[:2]
    size = resize_longest_side_size(h, w, self.model.image_encoder.img_size)
    if size != (h, w):
        x = F.interpolate(x, size, mode="bilinear", align_corners=False, antialias=True)
    self.set_torch_image(x, (h, w))


def _reference(model: Any, image: Tensor, settings: dict[str, Any]) -> list[dict[str, Any]]:
    generator = SamAutomaticMaskGenerator(model, **settings)
    generator.predictor.set_image = types.MethodType(_float_resize_set_image, generator.predictor)
    return generator.generate(image.numpy())


def _steps(
    generator: AutomaticMaskGenerator, image: Tensor, embedding: Tensor | None = None
) -> tuple[PerCrop, AutomaticMasks]:
    """The step API, run by hand as the service would."""
    original_size = (image.shape[0], image.shape[1])
    per_crop = []
    for job in generator.plan(original_size):
        if embedding is not None and job.is_full_image:
            emb = generator.embedding_for(job, embedding)
        else:
            emb = generator.encode_crop(image, job)
        per_crop.append([generator.decode_chunk(emb, job, c) for c in range(job.num_chunks)])
    return per_crop, generator.finish(per_crop, original_size)


def _assert_same_result(actual: AutomaticMasks, expected: AutomaticMasks) -> None:
    assert len(actual) == len(expected)
    for name in ("masks", "scores", "stability", "boxes", "areas", "point_coords", "crop_boxes"):
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name


@pytest.mark.parametrize("case", list(CASES))
def test_matches_meta_generator(case: str, blob_models, photo: Tensor, ours) -> None:
    settings = {**BASE, **CASES[case]}
    expected = _reference(blob_models[0], photo, settings)
    per_crop, result = ours(case)

    # not vacuous: many candidates pass the filters, NMS removes most, enough remain
    candidates = sum(len(c) for crop in per_crop for c in crop)
    assert len(result) >= 5 and candidates >= 3 * len(result)
    assert len(result) == len(expected)

    theirs = torch.stack([torch.from_numpy(r["segmentation"]) for r in expected])  # [N, H, W]
    mine_flat, theirs_flat = result.masks.flatten(1), theirs.flatten(1)
    inter = (mine_flat[:, None] & theirs_flat[None]).sum(-1)
    union = (mine_flat[:, None] | theirs_flat[None]).sum(-1)
    iou = inter / union.clamp(min=1)  # [ours, theirs]
    best, match = iou.max(dim=1)
    assert float(best.min()) >= 0.99
    assert sorted(match.tolist()) == list(range(len(expected)))  # one-to-one

    ref = [expected[j] for j in match.tolist()]
    torch.testing.assert_close(result.scores, _field(ref, "predicted_iou"), rtol=0, atol=1e-4)
    torch.testing.assert_close(result.stability, _field(ref, "stability_score"), rtol=0, atol=1e-3)
    assert (result.boxes - _field(ref, "bbox").long()).abs().max() <= 1
    assert (result.areas - _field(ref, "area").long()).abs().max() <= 0.01 * result.areas.max()
    torch.testing.assert_close(
        result.point_coords, _field(ref, "point_coords")[:, 0], rtol=0, atol=1e-3
    )
    assert torch.equal(result.crop_boxes, _field(ref, "crop_box").long())
    # best predicted IoU first
    assert bool((result.scores[1:] <= result.scores[:-1]).all())
    assert torch.equal(result.areas, result.masks.flatten(1).sum(dim=1))
    if case == "crops":
        full = torch.tensor([0, 0, photo.shape[1], photo.shape[0]])
        from_crops = int((result.crop_boxes != full).any(dim=1).sum())
        assert 0 < from_crops < len(result)
        # the NMS across crops removed duplicates too
        no_cross = AutomaticMaskSettings(**{**settings, "crop_nms_thresh": 1.0})
        size = (photo.shape[0], photo.shape[1])
        assert len(AutomaticMaskGenerator(blob_models[1], no_cross).finish(per_crop, size)) > len(
            result
        )


def _field(records: list[dict[str, Any]], key: str) -> Tensor:
    return torch.tensor([r[key] for r in records], dtype=torch.float32)


def test_small_regions_change_the_result(ours) -> None:
    """min_mask_region_area removes masks (else its parity case would prove little)."""
    assert 0 < len(ours("small_regions")[1]) < len(ours("full_image")[1])


def test_max_masks_keeps_the_best(blob_models, ours) -> None:
    per_crop, everything = ours("full_image")
    capped = AutomaticMaskGenerator(blob_models[1], AutomaticMaskSettings(**BASE, max_masks=3))
    best = capped.finish(per_crop, tuple(everything.masks.shape[1:]))
    assert len(best) == 3 and len(everything) > 3
    assert torch.equal(best.masks, everything.masks[:3])
    assert torch.equal(best.scores, everything.scores[:3])


def test_step_api_and_cached_embedding_equal_generate(blob_models, photo: Tensor) -> None:
    settings = AutomaticMaskSettings(
        **{**BASE, **CASES["crops"], "points_per_side": 8, "points_per_batch": 20}
    )
    generator = AutomaticMaskGenerator(blob_models[1], settings)
    whole = generator.generate(photo)
    assert len(whole) > 0
    _, stepped = _steps(generator, photo)
    _assert_same_result(stepped, whole)

    jobs = generator.plan((photo.shape[0], photo.shape[1]))
    assert [job.num_chunks for job in jobs] == [4, 1, 1, 1, 1]
    with torch.inference_mode():
        embedding = generator.encode_crop(photo, jobs[0]).embedding  # what the cache holds
    _, cached = _steps(generator, photo, embedding=embedding)
    _assert_same_result(cached, whole)
    _assert_same_result(generator.generate(photo, embedding=embedding[0]), whole)


def test_candidates_keep_only_low_res_logits(blob_models, photo: Tensor, tiny_config) -> None:
    generator = AutomaticMaskGenerator(blob_models[1], AutomaticMaskSettings(**BASE))
    job = generator.plan((photo.shape[0], photo.shape[1]))[0]
    assert job.num_chunks == 4 and job.num_points == 256
    emb = generator.encode_crop(photo, job)
    candidates = generator.decode_chunk(emb, job, 0)
    m = tiny_config.mask_input_size
    assert len(candidates) > 0 and candidates.low_res.shape == (len(candidates), m, m)
    with pytest.raises(IndexError):
        generator.decode_chunk(emb, job, 4)


def test_nothing_passes_gives_empty_result(tiny_sam: Sam, photo: Tensor) -> None:
    settings = AutomaticMaskSettings(points_per_side=4, pred_iou_thresh=1.0)
    result = AutomaticMaskGenerator(tiny_sam, settings).generate(photo)
    assert len(result) == 0
    assert result.masks.shape == (0, photo.shape[0], photo.shape[1])
    assert result.boxes.shape == (0, 4) and result.point_coords.shape == (0, 2)


def test_single_point_prompts_equal_pack_prompts() -> None:
    points = torch.tensor([[10.0, 20.5], [0.0, 255.0], [128.25, 3.0]])
    sets = [PromptSet(points=p[None], labels=[1]) for p in points]
    expected = pack_prompts(sets, [0, 0, 0], "cpu")
    actual = single_point_prompts(points)
    for name in ("image_index", "points", "point_labels", "token_valid"):
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name
    assert actual.mask_input is None and expected.mask_input is None


# -- the ops ---------------------------------------------------------------------------------


def _greedy_nms(boxes: Tensor, scores: Tensor, categories: Tensor, threshold: float) -> list[int]:
    """Greedy NMS written out literally: best score first (ties: lower index), per category."""
    box, score, category = boxes.tolist(), scores.tolist(), categories.tolist()
    area = [(b[2] - b[0]) * (b[3] - b[1]) for b in box]
    kept: list[int] = []
    for i in sorted(range(len(score)), key=lambda i: (-score[i], i)):
        suppressed = False
        for j in kept:
            if category[i] != category[j]:
                continue
            w = max(0.0, min(box[i][2], box[j][2]) - max(box[i][0], box[j][0]))
            h = max(0.0, min(box[i][3], box[j][3]) - max(box[i][1], box[j][1]))
            union = area[i] + area[j] - w * h
            if union > 0 and w * h / union > threshold:
                suppressed = True
                break
        if not suppressed:
            kept.append(i)
    return kept


@pytest.mark.parametrize(
    ("n", "categories", "threshold"), [(300, 1, 0.5), (400, 4, 0.7), (50, 2, 0.0)]
)
def test_nms_matches_greedy_reference(n: int, categories: int, threshold: float) -> None:
    g = torch.Generator().manual_seed(n)
    xy = (torch.rand(n, 2, generator=g) * 100).round()
    boxes = torch.cat([xy, xy + (torch.rand(n, 2, generator=g) * 40).round()], dim=1)
    boxes[:5, 2:] = boxes[:5, :2]  # zero-area boxes (NaN IoU: never suppressed)
    scores = (torch.rand(n, generator=g) * 20).round() / 20  # many ties
    category = torch.randint(0, categories, (n,), generator=g)
    keep = batched_nms(boxes, scores, category if categories > 1 else None, threshold)
    expected = _greedy_nms(boxes, scores, category if categories > 1 else torch.zeros(n), threshold)
    assert keep.tolist() == expected
    assert len(expected) < n  # something was suppressed
    assert batched_nms(boxes[:0], scores[:0], None, 0.5).shape == (0,)


def test_stability_score_matches_meta() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 37, 53, generator=g) * 3
    logits[0] = -5.0  # empty at both thresholds: 0/0
    expected = amg.calculate_stability_score(logits, 0.0, 1.0)
    actual = stability_score(logits, 0.0, 1.0)
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(-1), expected.nan_to_num(-1))


def test_masks_to_boxes_matches_meta() -> None:
    g = torch.Generator().manual_seed(1)
    masks = torch.rand(10, 30, 45, generator=g) > 0.995
    masks[0] = False
    masks[1] = False
    masks[1, 7, 9] = True
    assert torch.equal(masks_to_boxes(masks), amg.batched_mask_to_box(masks))


def _bfs_labels(mask: Tensor) -> Tensor:
    """8-connected components by breadth-first search: each pixel labelled with the flat index
    of its component's first pixel in raster order, background H * W."""
    H, W = mask.shape
    grid = mask.tolist()
    labels = [[H * W] * W for _ in range(H)]
    for y0 in range(H):
        for x0 in range(W):
            if not grid[y0][x0] or labels[y0][x0] != H * W:
                continue
            labels[y0][x0] = y0 * W + x0
            queue = deque([(y0, x0)])
            while queue:
                y, x = queue.popleft()
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        v, u = y + dy, x + dx
                        if 0 <= v < H and 0 <= u < W and grid[v][u] and labels[v][u] == H * W:
                            labels[v][u] = y0 * W + x0
                            queue.append((v, u))
    return torch.tensor(labels)


def _random_masks(k: int, h: int, w: int, seed: int) -> Tensor:
    """Blobby random masks: smoothed noise, thresholded."""
    g = torch.Generator().manual_seed(seed)
    noise = F.avg_pool2d(torch.rand(k, 1, h, w, generator=g), 5, stride=1, padding=2)
    return noise[:, 0] > 0.5


def _serpentine(h: int, w: int) -> Tensor:
    """One component snaking row by row: its path is about h * w / 2 pixels long."""
    mask = torch.zeros(h, w, dtype=torch.bool)
    mask[::2] = True
    for y in range(1, h, 2):
        mask[y, w - 1 if (y // 2) % 2 == 0 else 0] = True
    return mask


def test_connected_components_match_bfs() -> None:
    h, w = 40, 57
    masks = torch.cat(
        [
            _random_masks(5, h, w, seed=2),
            torch.ones(1, h, w, dtype=torch.bool),
            torch.zeros(1, h, w, dtype=torch.bool),
            _serpentine(h, w)[None],
        ]
    )
    for batch in (masks, ~masks):
        labels = connected_components(batch)
        for k in range(batch.shape[0]):
            assert torch.equal(labels[k], _bfs_labels(batch[k])), k


def test_remove_small_regions_matches_opencv() -> None:
    pytest.importorskip("cv2")
    masks = _random_masks(8, 48, 64, seed=4)
    masks[0] = False  # empty: nothing to change
    masks[1] = _random_masks(1, 48, 64, seed=5)[0] & (torch.rand(48, 64) > 0.7)  # specks only
    for area in (5, 30, 200):
        for mode in ("holes", "islands"):
            actual, changed = remove_small_regions(masks, area, mode)
            for k in range(masks.shape[0]):
                expected, expected_changed = amg.remove_small_regions(masks[k].numpy(), area, mode)
                assert torch.equal(actual[k], torch.from_numpy(expected)), (area, mode, k)
                assert bool(changed[k]) == expected_changed, (area, mode, k)


def test_point_grids_and_crop_boxes_match_meta() -> None:
    for n in (1, 2, 7, 16, 32):
        assert torch.equal(point_grid(n), torch.from_numpy(amg.build_point_grid(n)))
    for size in ((171, 256), (534, 800), (1500, 1000), (7, 5)):
        for layers in (0, 1, 2):
            boxes, layer = amg.generate_crop_boxes(size, layers, 512 / 1500)
            assert crop_boxes(size, layers, 512 / 1500) == [
                (tuple(b), i) for b, i in zip(boxes, layer, strict=True)
            ]


def test_memory_estimate_grows_with_image_and_batch(tiny_config: SamConfig) -> None:
    settings = AutomaticMaskSettings()
    small = estimate_peak_bytes(tiny_config, settings, (480, 640))
    large = estimate_peak_bytes(tiny_config, settings, (1500, 2250))
    assert large > small > 0
    # with the output capped, decoding is the peak, and it grows with the chunk size
    capped = estimate_peak_bytes(tiny_config, AutomaticMaskSettings(max_masks=50), (480, 640))
    bigger_batch = AutomaticMaskSettings(points_per_batch=256, max_masks=50)
    assert estimate_peak_bytes(tiny_config, bigger_batch, (480, 640)) > capped
    crops = AutomaticMaskSettings(crop_n_layers=1)
    assert estimate_peak_bytes(tiny_config, crops, (480, 640)) > small
    assert (
        estimate_peak_bytes(tiny_config, AutomaticMaskSettings(max_masks=50), (1500, 2250)) < large
    )
    half = estimate_peak_bytes(tiny_config, settings, (480, 640), torch.bfloat16)
    assert half < small


@pytest.mark.parametrize(
    "bad",
    [
        {"points_per_side": 0},
        {"points_per_batch": 0},
        {"pred_iou_thresh": 1.5},
        {"stability_score_thresh": float("nan")},
        {"crop_n_layers": -1},
        {"crop_overlap_ratio": 1.0},
        {"min_mask_region_area": -1},
        {"max_masks": 0},
    ],
)
def test_settings_reject_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AutomaticMaskSettings(**bad)


def test_plan_and_embedding_checks(tiny_sam: Sam, photo: Tensor) -> None:
    generator = AutomaticMaskGenerator(tiny_sam, AutomaticMaskSettings(crop_n_layers=1))
    jobs = generator.plan((171, 256))
    assert [j.layer for j in jobs] == [0, 1, 1, 1, 1]
    assert jobs[0].is_full_image and not jobs[1].is_full_image
    with pytest.raises(ValueError, match="full-image"):
        generator.embedding_for(jobs[1], torch.zeros(1, 256, 16, 16))
    with pytest.raises(ValueError, match="embedding must be"):
        generator.embedding_for(jobs[0], torch.zeros(1, 256, 8, 8))
    with pytest.raises(ValueError, match="plan"):
        generator.encode_crop(photo[:100], jobs[0])
    emb = generator.encode_crop(photo, jobs[1])
    with pytest.raises(ValueError, match="crop 1 given for crop 0"):
        generator.decode_chunk(emb, jobs[0], 0)
