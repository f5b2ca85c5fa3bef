"""SAM 2's decoder through `DecoderGraphs` (three image inputs: embedding, s0, s1).

On CUDA `Sam2Stages` replays a graph per (prompt sets, tokens) bucket. On the CPU no graph
is captured, but `decoder_graphs(graphs=False)` fills the same padded static buffers and
calls the same function (`_decode_tensors`, stability fallback and multimask columns
included) on them: a padded, bucketed batch must decode to what the batch gives alone,
for every prompt form, and rows an earlier batch filled must never leak into a later one.
`sam2_test_tiny`, seeded random weights, features of real photos.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from models.optimize import OptimizeOptions
from models.sam import PromptSet, pack_prompts
from models.sam.decoder_graphs import DecoderGraphs
from models.sam.prompts import PromptBatch
from models.sam2 import SAM2_CONFIGS, load_sam2
from server.domain import Prompt
from server.engine.sam2_stages import Sam2Stages
from server.engine.stages import DecodeItem, EncodeItem
from tests.server.test_sam2_stages_compile import dynamo, traced_stages  # noqa: F401 (a fixture)

TOL = 1e-4
MASK = 64  # sam2_test_tiny: 256 px, embedding 16, low-res masks 64
BUCKETS = [1, 2, 4, 8]


def _stages() -> Sam2Stages:
    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None, seed=0)
    return Sam2Stages(model, torch.device("cpu"), OptimizeOptions(), [1, 2], BUCKETS)


@pytest.fixture(scope="module")
def stages() -> Sam2Stages:
    return _stages()


@pytest.fixture(scope="module")
def photos(small_photo_dir: Path) -> list[np.ndarray]:
    out = []
    for path in sorted(small_photo_dir.iterdir())[:2]:
        with Image.open(path) as image:
            out.append(np.array(image.convert("RGB")))
    return out


@pytest.fixture(scope="module")
def features(stages: Sam2Stages, photos: list[np.ndarray]) -> list[tuple[Tensor, ...]]:
    """(embedding, s0, s1) of each photo, as the embedding cache holds them."""
    entries = stages.encode(
        [EncodeItem(f"p{k}", torch.from_numpy(p)) for k, p in enumerate(photos)]
    )
    return [e.tensors for e in entries]


@pytest.fixture()
def graphs(stages: Sam2Stages) -> DecoderGraphs:
    g = stages.decoder_graphs(graphs=False)
    assert not g.graphs and g.set_buckets == BUCKETS
    with torch.inference_mode():
        for sets in g.set_buckets:
            g.capture(sets)
    return g


def _set(kind: str, k: int, g: torch.Generator) -> PromptSet:
    """One prompt set of a form, in the model's 256 px input frame."""
    box = torch.tensor([20.0, 30.0, 150.0, 200.0]) + k
    points = int(kind[0]) if kind[0].isdigit() else 1
    xy = torch.rand(points, 2, generator=g) * 250
    labels = torch.randint(0, 2, (points,), generator=g)
    mask = torch.randn(1, MASK, MASK, generator=g) * 3
    none_xy, none_labels = torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)
    if kind == "box":
        return PromptSet(none_xy, none_labels, box, None)
    if kind == "box+point":
        return PromptSet(xy, labels, box, None)
    if kind == "mask":  # a refinement click: the point and the previous low-res logits
        return PromptSet(xy, labels, None, mask)
    if kind == "mask alone":
        return PromptSet(none_xy, none_labels, None, mask)
    return PromptSet(xy, labels, None, None)  # "1 point", "3 points", "6 points"


def _sets(kinds: list[str], seed: int) -> list[PromptSet]:
    g = torch.Generator().manual_seed(seed)
    return [_set(kind, k, g) for k, kind in enumerate(kinds)]


def _rows(features: list[tuple[Tensor, ...]], n: int) -> tuple[list[Tensor], ...]:
    """Set k on photo k % 2: one list per image input."""
    chosen = [features[k % 2] for k in range(n)]
    return tuple([f[i] for f in chosen] for i in range(3))


def _check(
    stages: Sam2Stages, graphs: DecoderGraphs, features: list[tuple[Tensor, ...]], sets
) -> tuple[Tensor, Tensor]:
    rows = _rows(features, len(sets))
    prompts = pack_prompts(sets, None, "cpu", mask_size=MASK)
    with torch.inference_mode():
        out = graphs.run_sets(rows, sets)
        assert out is not None
        want = stages._decode_tensors(*(torch.stack(r) for r in rows), prompts)
    for got, expected in zip(out, want, strict=True):
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert torch.allclose(got, expected, atol=TOL, rtol=TOL), (got - expected).abs().max()
    return out


FORMS = ["1 point", "3 points", "box", "box+point", "mask", "mask alone"]


@pytest.mark.parametrize("kind", FORMS)
def test_each_prompt_form_padded_decodes_as_alone(stages, graphs, features, kind) -> None:
    # 3 sets in the 4 bucket: one row padded; tokens padded to their bucket
    _check(stages, graphs, features, _sets([kind] * 3, FORMS.index(kind)))


def test_mixed_forms_and_the_largest_bucket(stages, graphs, features) -> None:
    _check(stages, graphs, features, _sets(FORMS, 11))  # 6 sets in the 8 bucket
    _check(stages, graphs, features, _sets(["6 points"], 12))  # 7 tokens in the 8 bucket
    _check(stages, graphs, features, _sets(["1 point"] * 8, 13))  # the bucket exactly


def test_stale_rows_of_a_larger_batch_never_leak(stages, graphs, features) -> None:
    # the first batch fills all 8 rows of the (8 sets, 8 tokens) buffers (7 tokens in
    # half the rows, mask inputs in the others, both photos); the second uses 5 rows of the
    # same buffers with at most 5 tokens, no mask input in some rows, the photos swapped
    _check(stages, graphs, features, _sets(["6 points", "mask"] * 4, 21))
    later = _sets(["1 point", "box", "4 points", "mask alone", "3 points"], 22)
    first = _check(stages, graphs, features[::-1], later)
    again = _check(stages, graphs, features[::-1], later)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_what_no_bucket_holds_is_left_to_the_compiled_decoder(graphs, features) -> None:
    too_many = _sets(["1 point"] * 9, 31)
    too_long = _sets(["8 points"], 32)
    with torch.inference_mode():
        assert graphs.run_sets(_rows(features, 9), too_many) is None
        assert graphs.run_sets(_rows(features, 1), too_long) is None
        with pytest.raises(ValueError, match="image inputs"):
            graphs.run_sets(_rows(features, 1)[:1], too_long)  # SAM's one-input call


def test_the_stages_decode_through_the_padded_buffers(photos) -> None:
    """`Sam2Stages.decode` with decoder graphs (as on CUDA: a mask input always, graphs
    captured by the warm-up) gives the plain stages' masks and scores; every decoder
    call after warm-up is on a whole bucket's buffers."""
    plain, graphed = _stages(), _stages()
    graphed.compiled = True  # a mask input always, every warm-up form: as compiled on CUDA
    graphed._graphs = buffers = graphed.decoder_graphs(graphs=False)
    graphed.warmup()
    assert buffers.captured == [(s, t) for s in BUCKETS for t in (2, 4, 8)]
    seen: list[PromptBatch] = []
    decode = buffers.decode

    def watched(*args: object) -> tuple[Tensor, Tensor]:
        seen.append(args[-1])  # type: ignore[arg-type]
        return decode(*args)

    buffers.decode = watched
    entries = graphed.encode(
        [EncodeItem(f"p{k}", torch.from_numpy(p)) for k, p in enumerate(photos)]
    )
    mask = torch.randn(1, MASK, MASK, generator=torch.Generator().manual_seed(5))

    def items(e0, e1) -> list[DecodeItem]:
        h, w = e0.original_size
        return [
            DecodeItem(e0, (Prompt(points=((w / 2, h / 2),), labels=(1,)),), True),
            DecodeItem(e1, (Prompt(box=(5.0, 8.0, 90.0, 120.0)),), False),
            DecodeItem(
                e0,
                (
                    Prompt(points=((w / 3, h / 3), (w / 4, h / 5)), labels=(1, 0)),
                    Prompt(points=((w / 3, h / 2),), labels=(1,), box=(2.0, 3.0, w / 2, h)),
                ),
                False,
            ),
            DecodeItem(e1, (Prompt(points=((30.0, 40.0),), labels=(1,)),), False, mask),
        ]

    plain_entries = plain.encode(
        [EncodeItem(f"p{k}", torch.from_numpy(p)) for k, p in enumerate(photos)]
    )
    got = graphed.decode(items(*entries))
    want = plain.decode(items(*plain_entries))
    assert [tuple(p.points.shape[:2]) for p in seen] == [(8, 4)]  # 5 sets, 4 tokens at most
    for got_item, want_item in zip(got, want, strict=True):
        for g_masks, w_masks in zip(got_item, want_item, strict=True):
            assert g_masks.masks is not None and w_masks.masks is not None
            assert (g_masks.masks != w_masks.masks).mean() <= 1e-5
            np.testing.assert_allclose(g_masks.scores, w_masks.scores, atol=1e-5)


@pytest.mark.usefixtures("dynamo")
def test_traced_whole_no_graph_more_and_none_under_load(photos) -> None:
    """Dynamo over the decoder with its graph buffers (as `tests/server/
    test_sam2_stages_compile.py` without them): the buckets' padded shapes fit the two
    graphs the warm-up traces anyway, and nothing recompiles after it, graphed or not."""
    traced: dict[str, list[object]] = {}
    stages = traced_stages(traced, decoder_graphs=True)
    assert stages._graphs is not None and len(stages._graphs.captured) == 12
    assert len(traced["decoder"]) == 2, traced
    entries = stages.encode(
        [EncodeItem(f"p{k}", torch.from_numpy(p)) for k, p in enumerate(photos)]
    )
    ten = tuple((5.0 * k, 4.0 * k) for k in range(1, 11))  # 11 tokens: no graph's
    batches = [
        [DecodeItem(entries[k % 2], (Prompt(points=((40.0, 30.0 + k),), labels=(1,)),), False)
         for k in range(7)],
        [DecodeItem(entries[0], (Prompt(points=ten, labels=(1,) * 10),), True),
         DecodeItem(entries[1], (Prompt(box=(5.0, 6.0, 70.0, 90.0)),), False)],
    ]  # fmt: skip
    torch.compiler.set_stance("fail_on_recompile")
    served = [stages.decode(items) for items in batches]  # raises if dynamo needed a graph
    torch.compiler.set_stance("default")
    plain = _stages()
    plain_entries = plain.encode(
        [EncodeItem(f"p{k}", torch.from_numpy(p)) for k, p in enumerate(photos)]
    )
    by_id = {e.image_id: e for e in plain_entries}
    for items, results in zip(batches, served, strict=True):
        moved = [replace(i, embedding=by_id[i.embedding.image_id]) for i in items]
        for got, want in zip(results, plain.decode(moved), strict=True):
            for g_masks, w_masks in zip(got, want, strict=True):
                assert g_masks.masks is not None and w_masks.masks is not None
                assert (g_masks.masks != w_masks.masks).mean() <= 1e-5
                np.testing.assert_allclose(g_masks.scores, w_masks.scores, atol=1e-5)


def test_a_refused_capture_turns_the_graphs_off_and_decoding_goes_on(photos, caplog) -> None:
    """A device that refuses a capture (an op that syncs, a driver's limit) must not stop
    start-up: the warm-up logs why and the decoder runs as it does without graphs."""
    plain, graphed = _stages(), _stages()
    graphed.compiled = True
    graphed._graphs = buffers = graphed.decoder_graphs(graphs=False)
    decode = buffers.decode

    def refusing(*args: object) -> tuple[Tensor, Tensor]:
        if args[0].shape[0] == 2:  # type: ignore[attr-defined]  # the 2-set bucket
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return decode(*args)

    buffers.decode = refusing
    with caplog.at_level(logging.WARNING, logger="server.engine.stages"):
        graphed.warmup()
    assert graphed._graphs is None
    assert "decoder CUDA graphs off: capturing 2 prompt sets failed" in caplog.text
    (entry,) = graphed.encode([EncodeItem("p", torch.from_numpy(photos[0]))])
    (plain_entry,) = plain.encode([EncodeItem("p", torch.from_numpy(photos[0]))])
    h, w = entry.original_size
    prompt = (Prompt(points=((w / 2, h / 2),), labels=(1,)),)
    (got,) = graphed.decode([DecodeItem(entry, prompt, True)])
    (want,) = plain.decode([DecodeItem(plain_entry, prompt, True)])
    assert got[0].masks is not None and want[0].masks is not None
    assert (got[0].masks != want[0].masks).mean() <= 1e-5
    np.testing.assert_allclose(got[0].scores, want[0].scores, atol=1e-5)
