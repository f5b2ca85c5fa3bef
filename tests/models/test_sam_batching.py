"""Prompt packing: canonical tokens, padding, and "decoded in a batch == decoded alone"."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from models.sam import PromptSet, Sam, pack_prompts

BATCH_TOL = 1e-5


def _mixed_sets() -> tuple[list[PromptSet], list[int]]:
    """Sets of every kind and length over two images."""
    g = torch.Generator().manual_seed(21)

    def pts(n: int) -> Tensor:
        return torch.rand(n, 2, generator=g) * 250

    def lbl(n: int) -> Tensor:
        return torch.randint(0, 2, (n,), generator=g)

    def box() -> Tensor:
        xy = torch.rand(2, generator=g) * 150
        return torch.cat([xy, xy + 10 + torch.rand(2, generator=g) * 90])

    def mask() -> Tensor:
        return torch.randn(1, 64, 64, generator=g) * 3

    sets = [
        PromptSet(pts(1), lbl(1)),
        PromptSet(pts(5), lbl(5)),
        PromptSet(box=box()),
        *[PromptSet(box=box()) for _ in range(10)],
        PromptSet(pts(3), lbl(3), box()),
        PromptSet(pts(2), lbl(2), mask_input=mask()),
        PromptSet(box=box(), mask_input=mask()),
        PromptSet(mask_input=mask()),
        PromptSet(pts(4), torch.tensor([1, 0, -1, 1]), box(), mask()),
    ]
    image_index = [k % 2 for k in range(len(sets))]
    return sets, image_index


@pytest.fixture(scope="module")
def embeddings(tiny_sam: Sam) -> Tensor:
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        return tiny_sam.encode(torch.randn(2, 3, 256, 256, generator=g))


def test_batched_decode_equals_alone(tiny_sam: Sam, embeddings: Tensor, rel_err) -> None:
    sets, image_index = _mixed_sets()
    with torch.inference_mode():
        low_res, iou = tiny_sam.decode(embeddings, pack_prompts(sets, image_index, "cpu"))
        assert low_res.shape == (len(sets), 4, 64, 64) and iou.shape == (len(sets), 4)
        for p, (prompt, i) in enumerate(zip(sets, image_index, strict=True)):
            alone = pack_prompts([prompt], [0], "cpu")
            one_low_res, one_iou = tiny_sam.decode(embeddings[i : i + 1], alone)
            assert rel_err(low_res[p : p + 1], one_low_res) < BATCH_TOL, p
            assert rel_err(iou[p : p + 1], one_iou) < BATCH_TOL, p


def test_one_row_per_set_needs_no_index(tiny_sam: Sam, embeddings: Tensor, rel_err) -> None:
    """Without `image_index`, row p is set p's embedding: the same masks as the gather,
    which the service's decoder stage no longer pays for; a count mismatch is refused."""
    sets, image_index = _mixed_sets()
    rows = embeddings[image_index]  # [P, C, h, w], as the stage stacks them
    with torch.inference_mode():
        gathered = tiny_sam.decode(embeddings, pack_prompts(sets, image_index, "cpu"))
        direct = pack_prompts(sets, None, "cpu")
        assert direct.image_index is None
        as_is = tiny_sam.decode(rows, direct)
        assert rel_err(gathered[0], as_is[0]) < BATCH_TOL
        assert rel_err(gathered[1], as_is[1]) < BATCH_TOL
        with pytest.raises(ValueError, match="one embedding per prompt set"):
            tiny_sam.decode(embeddings, direct)


def test_padding_tokens_do_not_leak(tiny_sam: Sam, embeddings: Tensor) -> None:
    """Changing a padding token's coordinates changes nothing."""
    batch = pack_prompts(
        [PromptSet(box=[10, 10, 90, 90]), PromptSet([[5, 5]] * 6, [1] * 6)], [0, 1], "cpu"
    )
    assert not bool(batch.token_valid[0, 2:].any())
    moved = batch.points.clone()
    moved[0, 2:] = 123.0
    other = type(batch)(batch.image_index, moved, batch.point_labels, batch.token_valid)
    with torch.inference_mode():
        a, _ = tiny_sam.decode(embeddings, batch)
        b, _ = tiny_sam.decode(embeddings, other)
    assert torch.equal(a, b)


def test_canonical_tokens_follow_meta() -> None:
    sets = [
        PromptSet([[1.0, 2.0]], [1]),  # point + "not a point" pad
        PromptSet(box=[3.0, 4.0, 5.0, 6.0]),  # two corners
        PromptSet([[7.0, 8.0]], [0], [1.0, 1.0, 9.0, 9.0]),  # point + corners
        PromptSet(mask_input=torch.zeros(1, 64, 64)),  # no tokens
    ]
    batch = pack_prompts(sets, torch.tensor([0, 0, 1, 1]), "cpu")
    assert batch.point_labels.tolist() == [
        [1, -1, -2],
        [2, 3, -2],
        [0, 2, 3],
        [-2, -2, -2],
    ]
    assert batch.token_valid.tolist() == [
        [True, True, False],
        [True, True, False],
        [True, True, True],
        [False, False, False],
    ]
    assert batch.points[0].tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    assert batch.points[2].tolist() == [[7.0, 8.0], [1.0, 1.0], [9.0, 9.0]]
    assert batch.has_mask_input is not None and batch.has_mask_input.tolist() == [0, 0, 0, 1]
    assert batch.image_index.dtype == torch.int64


def test_no_mask_inputs_means_no_mask_tensors() -> None:
    batch = pack_prompts([PromptSet(box=[0, 0, 4, 4])], [0], "cpu")
    assert batch.mask_input is None and batch.has_mask_input is None


@pytest.mark.parametrize(
    ("sets", "index", "message"),
    [
        ([], [], "at least one"),
        ([PromptSet([[1, 2]], [1])], [0, 1], "image indexes"),
        ([PromptSet([[1, 2], [3, 4]], [1])], [0], "labels"),
        ([PromptSet([[1, 2]], [2])], [0], "labels must be"),
        ([PromptSet(box=[1, 2, 3])], [0], "4 coordinates"),
        (
            [
                PromptSet(mask_input=torch.zeros(1, 64, 64)),
                PromptSet(mask_input=torch.zeros(1, 32, 32)),
            ],
            [0, 0],
            "mask inputs",
        ),
    ],
)
def test_pack_prompts_rejects_bad_sets(sets, index, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_prompts(sets, index, "cpu")


def test_decode_rejects_wrong_mask_size(tiny_sam: Sam, embeddings: Tensor) -> None:
    batch = pack_prompts([PromptSet(mask_input=torch.zeros(1, 32, 32))], [0], "cpu")
    with pytest.raises(ValueError, match="mask_input"):
        tiny_sam.decode(embeddings, batch)


def test_zero_mask_input_flagged_absent_changes_nothing(tiny_sam: Sam, embeddings: Tensor) -> None:
    """`pack_prompts(mask_size=...)` (one compiled graph for every form) gives the masks of
    the batch without a mask input, and a set with a real mask still gets its own."""
    side = 4 * tiny_sam.config.embedding_size
    sets = [
        PromptSet(points=torch.tensor([[10.0, 20.0]]), labels=torch.tensor([1])),
        PromptSet(box=torch.tensor([5.0, 5.0, 40.0, 50.0])),
    ]
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        plain = tiny_sam.decode(embeddings, pack_prompts(sets, [0, 1], "cpu"))
        padded = tiny_sam.decode(embeddings, pack_prompts(sets, [0, 1], "cpu", mask_size=side))
        assert torch.equal(plain[0], padded[0]) and torch.equal(plain[1], padded[1])
        mask = torch.randn(1, side, side, generator=g) * 10
        refined = [sets[0], PromptSet(box=sets[1].box, mask_input=mask)]
        mixed = tiny_sam.decode(embeddings, pack_prompts(refined, [0, 1], "cpu", mask_size=side))
        assert torch.equal(mixed[0][0], plain[0][0])  # the set without a mask: unchanged
        assert not torch.allclose(mixed[0][1], plain[0][1])  # the refined one moved
