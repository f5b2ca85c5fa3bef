"""SAM 2's segment everything: parity with Meta's `SAM2AutomaticMaskGenerator`.

Meta's model (its own `build_sam2`, tiny test sizes) gets seeded random weights changed to
draw blobs, is saved in the official format and loaded into ours. Both generators run on the
same real photo with the same settings; every mask of ours must match a distinct mask of
Meta's (IoU >= 0.98), with the same count, scores, stability, boxes, areas and prompts.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from models.sam.automatic import MaskCandidates
from models.sam2 import SAM2_CONFIGS, Sam2, Sam2Config, Sam2Features, load_sam2
from models.sam2.automatic import (
    AutomaticMasks,
    Sam2AutomaticMaskGenerator,
    Sam2AutomaticMaskSettings,
    compiled_call,
    point_decoder,
    preprocess_crop,
)
from models.sam2.transforms import preprocess_image
from tests.conftest import PHOTOS
from tests.models.sam2_blobs import blob_weights
from tests.models.sam2_reference import build_reference_sam2, randomize, save_official

PHOTO_SIZE = (256, 171)  # (W, H): stretched to the tiny model's 256 x 256 input
MIN_IOU = 0.98

# With random weights every mask covers most of the image (its logits are mostly positive
# and barely depend on the click), so every box is the image and NMS keeps one mask. A
# high `mask_threshold` (a generator argument, given to both alike) keeps each mask's
# strongest region: dozens of different masks, of which NMS removes most.
BASE: dict[str, Any] = {
    "points_per_side": 12,
    "pred_iou_thresh": 0.01,
    "stability_score_thresh": 0.6,
    "mask_threshold": 30.0,
}
CASES: dict[str, dict[str, Any]] = {
    "full_image": {},
    "crops": {"crop_n_layers": 1, "crop_n_points_downscale_factor": 2, "crop_nms_thresh": 0.5},
    "single_mask": {"multimask_output": False},
    "m2m": {"use_m2m": True},
}
PerCrop = list[list[MaskCandidates]]


@pytest.fixture(scope="module")
def config() -> Sam2Config:
    return SAM2_CONFIGS["sam2_test_tiny"]


@pytest.fixture(scope="module")
def photo() -> Tensor:
    """dog.jpg, downscaled to 256x171: uint8 `[171, 256, 3]`."""
    image = Image.open(PHOTOS / "dog.jpg").convert("RGB")
    return torch.from_numpy(np.array(image.resize(PHOTO_SIZE, Image.Resampling.BILINEAR)))


@pytest.fixture(scope="module")
def blob_models(tmp_path_factory: pytest.TempPathFactory, config: Sam2Config) -> tuple[Any, Sam2]:
    """(Meta's SAM2Base, ours from its official-format file) on random weights that draw
    blobs: the decoder's two transposed convolutions get one weight for all four taps
    (each embedding cell a flat block), the high-res skips are zeroed (they would add
    per-pixel noise) and the hypernetwork outputs scaled up (sharp, stable logits)."""
    reference = build_reference_sam2(config, override_sizes=True)
    randomize(reference, seed=1234)
    blob_weights(reference)
    path = save_official(reference, tmp_path_factory.mktemp("sam2_amg") / "sam2_blobs.pt")
    return reference, load_sam2(config, path)


def _reference(
    model: Any, config: Sam2Config, image: Tensor, settings: dict[str, Any]
) -> list[dict[str, Any]]:
    from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator

    generator = SAM2AutomaticMaskGenerator(copy.deepcopy(model), **settings)
    e = config.embedding_size  # Meta hard-codes its 1024-px feature sizes
    generator.predictor._bb_feat_sizes = [(4 * e, 4 * e), (2 * e, 2 * e), (e, e)]
    return generator.generate(image.numpy())


def _steps(
    generator: Sam2AutomaticMaskGenerator, image: Tensor, features: Any = None
) -> tuple[PerCrop, AutomaticMasks]:
    """The step API, run by hand as the service would."""
    size = (image.shape[0], image.shape[1])
    per_crop = []
    for job in generator.plan(size):
        if features is not None and job.is_full_image:
            emb = generator.embedding_for(job, features)
        else:
            emb = generator.encode_crop(image, job)
        per_crop.append([generator.decode_chunk(emb, job, c) for c in range(job.num_chunks)])
    return per_crop, generator.finish(per_crop, size)


def _field(records: list[dict[str, Any]], key: str) -> Tensor:
    return torch.tensor([r[key] for r in records], dtype=torch.float32)


def _pair_iou(ours: Tensor, theirs: Tensor) -> Tensor:
    """`[N, H, W]`, `[M, H, W]` bool -> IoU `[N, M]`."""
    a, b = ours.flatten(1), theirs.flatten(1)
    inter = (a[:, None] & b[None]).sum(-1)
    union = (a[:, None] | b[None]).sum(-1)
    return inter / union.clamp(min=1)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_meta_generator(case: str, blob_models, config, photo: Tensor) -> None:
    reference, ours = blob_models
    settings = {**BASE, **CASES[case]}
    expected = _reference(reference, config, photo, settings)
    per_crop, result = _steps(
        Sam2AutomaticMaskGenerator(ours, Sam2AutomaticMaskSettings(**settings)), photo
    )

    # not vacuous: many candidates pass the filters, NMS removes most, enough remain
    candidates = sum(len(c) for crop in per_crop for c in crop)
    assert len(result) >= 5 and candidates >= 3 * len(result)
    assert len(result) == len(expected)

    theirs = torch.stack([torch.from_numpy(r["segmentation"]) for r in expected])
    best, match = _pair_iou(result.masks, theirs).max(dim=1)
    assert float(best.min()) >= MIN_IOU
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
    assert bool((result.scores[1:] <= result.scores[:-1]).all())  # best predicted IoU first
    if case == "crops":
        full = torch.tensor([0, 0, photo.shape[1], photo.shape[0]])
        assert 0 < int((result.crop_boxes != full).any(dim=1).sum()) < len(result)


def test_defaults_are_metas() -> None:
    """SAM 2's generator defaults (not SAM's: pred_iou_thresh 0.8), read from Meta's code."""
    from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator

    params = inspect.signature(SAM2AutomaticMaskGenerator.__init__).parameters
    ours = Sam2AutomaticMaskSettings()
    names = [
        "points_per_side",
        "points_per_batch",
        "pred_iou_thresh",
        "stability_score_thresh",
        "stability_score_offset",
        "mask_threshold",
        "box_nms_thresh",
        "crop_n_layers",
        "crop_nms_thresh",
        "crop_overlap_ratio",
        "crop_n_points_downscale_factor",
        "min_mask_region_area",
        "use_m2m",
        "multimask_output",
    ]
    for name in names:
        assert getattr(ours, name) == params[name].default, name
    assert ours.pred_iou_thresh == 0.8


def test_step_api_and_cached_features_equal_generate(blob_models, photo: Tensor) -> None:
    settings = Sam2AutomaticMaskSettings(**{**BASE, **CASES["crops"], "points_per_batch": 100})
    generator = Sam2AutomaticMaskGenerator(blob_models[1], settings)
    whole = generator.generate(photo)
    assert len(whole) > 0
    jobs = generator.plan((photo.shape[0], photo.shape[1]))
    assert [job.num_chunks for job in jobs] == [2, 1, 1, 1, 1]
    with torch.inference_mode():
        features = generator.encode_crop(photo, jobs[0]).embedding  # what the cache holds
    for result in (_steps(generator, photo, features)[1], generator.generate(photo, features)):
        assert len(result) == len(whole)
        for name in ("masks", "scores", "stability", "boxes", "areas", "point_coords"):
            assert torch.equal(getattr(result, name), getattr(whole, name)), name


def test_device_preprocessing_equals_the_numpy_one(config: Sam2Config, photo: Tensor) -> None:
    torch.testing.assert_close(
        preprocess_crop(photo, config), preprocess_image(photo.numpy(), config), rtol=0, atol=0
    )


def test_embedding_checks_and_chunks(blob_models, photo: Tensor, config: Sam2Config) -> None:
    generator = Sam2AutomaticMaskGenerator(blob_models[1], Sam2AutomaticMaskSettings(**BASE))
    jobs = generator.plan((photo.shape[0], photo.shape[1]))
    assert len(jobs) == 1 and jobs[0].num_chunks == 3 and jobs[0].input_size == (256, 256)
    emb = generator.encode_crop(photo, jobs[0])
    candidates = generator.decode_chunk(emb, jobs[0], 0)
    m = config.mask_input_size
    assert len(candidates) > 0 and candidates.low_res.shape == (len(candidates), m, m)
    with pytest.raises(IndexError):
        generator.decode_chunk(emb, jobs[0], 3)
    wrong = type(emb.embedding)(emb.embedding.image_embed[:, :8], emb.embedding.high_res)
    with pytest.raises(ValueError, match="image_embed"):
        generator.embedding_for(jobs[0], wrong)


def test_nothing_passes_gives_empty_result(blob_models, photo: Tensor) -> None:
    settings = Sam2AutomaticMaskSettings(points_per_side=4, pred_iou_thresh=1.0)
    result = Sam2AutomaticMaskGenerator(blob_models[1], settings).generate(photo)
    assert len(result) == 0 and result.masks.shape == (0, photo.shape[0], photo.shape[1])


@pytest.mark.parametrize(
    "bad",
    [{"min_mask_region_area": 100}, {"mask_threshold": float("nan")}, {"pred_iou_thresh": 2.0}],
)
def test_settings_reject_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Sam2AutomaticMaskSettings(**bad)


def test_memory_estimate_grows_with_image_batch_and_m2m(blob_models) -> None:
    model = blob_models[1]

    def estimate(size: tuple[int, int], **fields: Any) -> int:
        settings = Sam2AutomaticMaskSettings(**fields)
        return Sam2AutomaticMaskGenerator(model, settings).estimate_peak_bytes(size)

    small = estimate((171, 256))
    assert small > 0
    assert estimate((1710, 2560)) > small
    assert estimate((171, 256), points_per_batch=256) > small
    assert estimate((171, 256), use_m2m=True) > small


@pytest.mark.parametrize("multimask", [True, False])
def test_a_compiled_point_decoder_is_one_graph_with_the_eager_masks(
    multimask: bool, blob_models, photo: Tensor
) -> None:
    """The decoder call the service and the benches compile (`point_decoder`) traces whole
    (fullgraph, the chunk size dynamic) and gives the eager generator's masks. aot_eager
    here: dynamo's capture without code generation; inductor's kernels run on the GPU
    (`python -m bench.sam2`, docs/BENCHMARKS.md)."""
    _, ours = blob_models
    settings = Sam2AutomaticMaskSettings(**{**BASE, "multimask_output": multimask})
    torch._dynamo.reset()
    compiled = torch.compile(point_decoder(ours), backend="aot_eager", fullgraph=True, dynamic=True)
    _, eager = _steps(Sam2AutomaticMaskGenerator(ours, settings), photo)
    _, got = _steps(Sam2AutomaticMaskGenerator(ours, settings, compiled), photo)
    assert len(eager) >= 5
    assert torch.equal(got.masks, eager.masks)
    assert torch.equal(got.scores, eager.scores)


def test_the_compiled_call_serves_every_request_with_warm_ups_graph(photo: Tensor) -> None:
    """Warmed once as `Sam2Stages.warm_everything` does (64 points, fresh tensors), the
    compiled call must take requests as the service brings them without recompiling: the
    service serves under a no-recompile stance, where a missed graph silently runs eagerly
    (what happened on the H100). Their chunks hold 256 or 100 points; their features are a
    row of the encoder's batch, s1 channels-last; their point grid is made outside
    inference mode. Each broke the graph before `compiled_call`: duck sizing tied the
    point count to s1's 64 channels, and the graph guarded the kind of tensor and strides."""
    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None).eval()
    d, e = model.config.d_model, model.config.embedding_size
    assert d // 4 == 64  # the collision: s1 has 64 channels, the warm-up 64 points
    with torch.inference_mode():
        warm = [torch.zeros(shape) for shape in ((1, d, e, e), (1, d // 8, 4 * e, 4 * e),
                                                  (1, d // 4, 2 * e, 2 * e))]  # fmt: skip
        points = torch.full((64, 2), model.config.image_size / 2)
        two = model.encode(preprocess_image(photo.numpy(), model.config).expand(2, -1, -1, -1))
    s0, s1 = two.high_res
    row = Sam2Features(two.image_embed[1:], (s0[1:], s1[1:].to(memory_format=torch.channels_last)))

    def serve(decode: Any) -> None:
        with torch.inference_mode():
            decode(*warm, points, True)
        with torch.compiler.set_stance("fail_on_recompile"):
            for batch in (256, 100):
                fields = {"points_per_side": 12, "points_per_batch": batch}
                settings = Sam2AutomaticMaskSettings(
                    **fields, pred_iou_thresh=0.0, stability_score_thresh=0.0
                )
                _, found = _steps(Sam2AutomaticMaskGenerator(model, settings, decode), photo, row)
                assert len(found.scores) > 0

    torch._dynamo.reset()
    every_size = torch.compile(point_decoder(model), backend="aot_eager", dynamic=True)
    with pytest.raises(RuntimeError, match="recompile"):
        serve(every_size)
    torch._dynamo.reset()
    serve(compiled_call(torch.compile(point_decoder(model), backend="aot_eager", fullgraph=True)))
