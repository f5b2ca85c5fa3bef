"""Parity with Meta's segment-anything on the same random weights (saved as an official .pth).

Meta's model runs through its own entry points (`image_encoder`, `SamPredictor.predict_torch`,
`Sam.postprocess_masks`); ours through `encode`, `pack_prompts` + `decode` and
`postprocess_masks`. fp32 outputs must agree to a relative error below 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from segment_anything import SamPredictor, sam_model_registry
from torch import Tensor

from models.sam import SAM_CONFIGS, PromptSet, Sam, load_sam, pack_prompts
from models.sam.transforms import postprocess_masks, preprocess_images

TOL = 1e-4
ORIGINAL_SIZE = (240, 320)  # H, W before the resize to the 192x256 input below


@dataclass(frozen=True)
class Case:
    """One `predict_torch` call: K prompt sets on one image (None = prompt type absent)."""

    name: str
    points: Tensor | None  # [K, N, 2]
    labels: Tensor | None  # [K, N]
    boxes: Tensor | None  # [K, 4]
    masks: Tensor | None  # [K, 1, 64, 64]

    @property
    def num_sets(self) -> int:
        for t in (self.points, self.boxes, self.masks):
            if t is not None:
                return t.shape[0]
        raise AssertionError("empty case")

    def prompt_sets(self) -> list[PromptSet]:
        return [
            PromptSet(
                points=self.points[k] if self.points is not None else (),
                labels=self.labels[k] if self.labels is not None else (),
                box=self.boxes[k] if self.boxes is not None else None,
                mask_input=self.masks[k] if self.masks is not None else None,
            )
            for k in range(self.num_sets)
        ]


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(7)

    def pts(k: int, n: int) -> Tensor:
        return torch.rand(k, n, 2, generator=g) * torch.tensor([256.0, 192.0])

    def lbl(k: int, n: int) -> Tensor:
        return torch.randint(0, 2, (k, n), generator=g)

    def box(k: int) -> Tensor:
        xy0 = torch.rand(k, 2, generator=g) * 120
        return torch.cat([xy0, xy0 + 20 + torch.rand(k, 2, generator=g) * 60], dim=1)

    def mask(k: int) -> Tensor:
        return torch.randn(k, 1, 64, 64, generator=g) * 4

    return [
        Case("one_point", pts(1, 1), lbl(1, 1), None, None),
        Case("points_only", pts(1, 4), lbl(1, 4), None, None),
        Case("box_only", None, None, box(1), None),
        Case("points_and_box", pts(1, 3), lbl(1, 3), box(1), None),
        Case("several_boxes", None, None, box(6), None),
        Case("batched_points", pts(3, 2), lbl(3, 2), None, None),
        Case("points_with_mask", pts(1, 2), lbl(1, 2), None, mask(1)),
        Case("box_with_mask", None, None, box(2), mask(2)),
        Case("mask_only", None, None, None, mask(1)),
    ]


CASES = _cases()


@pytest.fixture(scope="module")
def image() -> Tensor:
    """A uint8 [192, 256, 3] image, already at the model input size (long side 256)."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (192, 256, 3), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="module")
def predictor(reference_sam, image: Tensor) -> SamPredictor:
    predictor = SamPredictor(reference_sam)
    predictor.set_torch_image(image.permute(2, 0, 1)[None].float(), ORIGINAL_SIZE)
    return predictor


@pytest.fixture(scope="module")
def embedding(tiny_sam: Sam, tiny_config, image: Tensor) -> Tensor:
    batch, sizes = preprocess_images([image], tiny_config, "cpu")
    assert sizes == [(192, 256)]
    with torch.inference_mode():
        return tiny_sam.encode(batch)


@pytest.mark.parametrize("name", ["vit_b", "vit_l", "vit_h"])
def test_state_dict_layout_matches_meta_registry(name: str) -> None:
    with torch.device("meta"):
        reference = sam_model_registry[name]()
        ours = Sam(SAM_CONFIGS[name])
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    actual = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert actual == expected
    assert {k for k, _ in reference.named_buffers()} == {k for k, _ in ours.named_buffers()}


def test_vit_b_official_file_loads_with_strict_keys(tmp_path) -> None:
    with torch.device("meta"):
        reference = sam_model_registry["vit_b"]()
    state = {k: torch.zeros(v.shape) for k, v in reference.state_dict().items()}
    path = tmp_path / "sam_vit_b_layout.pth"
    torch.save(state, path)
    model = load_sam(SAM_CONFIGS["vit_b"], path)
    assert set(model.state_dict()) == set(state)
    assert model.pixel_mean.flatten().tolist() == pytest.approx([123.675, 116.28, 103.53])


def test_image_embeddings_match(reference_sam, tiny_sam: Sam, rel_err) -> None:
    g = torch.Generator().manual_seed(11)
    images = torch.randn(2, 3, 256, 256, generator=g)
    with torch.inference_mode():
        expected = reference_sam.image_encoder(images)
        actual = tiny_sam.encode(images)
    assert actual.shape == expected.shape == (2, 256, 16, 16)
    assert rel_err(actual, expected) < TOL


def test_predictor_embedding_matches(predictor: SamPredictor, embedding: Tensor, rel_err) -> None:
    assert rel_err(embedding, predictor.get_image_embedding()) < TOL


@pytest.mark.parametrize("multimask", [False, True], ids=["single", "multi"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decode_matches_predict_torch(
    case: Case, multimask: bool, predictor, tiny_sam: Sam, tiny_config, embedding, rel_err
) -> None:
    logits, iou, low_res = predictor.predict_torch(
        case.points, case.labels, case.boxes, case.masks, multimask, return_logits=True
    )
    prompts = pack_prompts(case.prompt_sets(), [0] * case.num_sets, "cpu")
    with torch.inference_mode():
        all_low_res, all_iou = tiny_sam.decode(embedding, prompts)
    chosen = slice(1, None) if multimask else slice(0, 1)
    ours_low_res, ours_iou = all_low_res[:, chosen], all_iou[:, chosen]
    assert ours_low_res.shape == low_res.shape
    assert rel_err(ours_low_res, low_res) < TOL
    assert rel_err(ours_iou, iou) < TOL
    ours_logits = postprocess_masks(ours_low_res, (192, 256), ORIGINAL_SIZE, tiny_config)
    assert ours_logits.shape == logits.shape == (case.num_sets, ours_iou.shape[1], *ORIGINAL_SIZE)
    assert rel_err(ours_logits, logits) < TOL


def test_two_images_in_one_decode_match_meta(reference_sam, tiny_sam: Sam, rel_err) -> None:
    """Sets from two images in one call agree with Meta's per-image decoding."""
    g = torch.Generator().manual_seed(5)
    images = torch.randn(2, 3, 256, 256, generator=g)
    boxes = torch.tensor([[10.0, 20.0, 90.0, 150.0], [100.0, 40.0, 250.0, 200.0]])
    points = torch.tensor([[[30.0, 40.0], [200.0, 100.0]]])
    labels = torch.tensor([[1, 0]])
    sets = [PromptSet(box=boxes[0]), PromptSet(points[0], labels[0]), PromptSet(box=boxes[1])]
    with torch.inference_mode():
        embeddings = tiny_sam.encode(images)
        low_res, iou = tiny_sam.decode(embeddings, pack_prompts(sets, [1, 0, 1], "cpu"))
        ref_embeddings = reference_sam.image_encoder(images)
        pe = reference_sam.prompt_encoder.get_dense_pe()
        expected = []
        for image_index, points_arg, boxes_arg in [
            (1, None, boxes[:1]),
            (0, (points, labels), None),
            (1, None, boxes[1:]),
        ]:
            sparse, dense = reference_sam.prompt_encoder(points_arg, boxes_arg, None)
            expected.append(
                reference_sam.mask_decoder(
                    ref_embeddings[image_index : image_index + 1], pe, sparse, dense, True
                )
            )
    for k, (ref_masks, ref_iou) in enumerate(expected):
        assert rel_err(low_res[k : k + 1, 1:], ref_masks) < TOL
        assert rel_err(iou[k : k + 1, 1:], ref_iou) < TOL
