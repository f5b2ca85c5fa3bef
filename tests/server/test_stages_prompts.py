"""Prompt coordinates reach the decoder as Meta's path computes them: clipped to the image
in float32, then scaled by a float64 product rounded to float32 (`scale_coords`). The
worker does this in numpy for speed; here it is checked bit for bit against the torch
transforms, points and boxes inside, across and wholly outside images of many sizes."""

from __future__ import annotations

import numpy as np
import torch

from models.optimize import OptimizeOptions
from models.sam import SAM_CONFIGS, load_sam
from models.sam import transforms as sam_tf
from server.domain import Prompt
from server.engine.cache import ImageEmbedding
from server.engine.stages import DecodeItem, EncodeItem, SamStages


def reference(prompt: Prompt, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    config = SAM_CONFIGS["vit_tiny"]
    limit = torch.tensor([size[1], size[0]], dtype=torch.float32)
    points = torch.tensor(prompt.points, dtype=torch.float32).reshape(-1, 2)
    points = sam_tf.scale_coords(points.clamp(min=torch.zeros(2), max=limit), size, config)
    if prompt.box is None:
        return points, None
    corners = torch.tensor(prompt.box, dtype=torch.float32).reshape(2, 2)
    corners = corners.clamp(min=torch.zeros(2), max=limit)
    return points, sam_tf.scale_coords(corners, size, config).reshape(4)


def test_prompt_coordinates_are_clipped_and_scaled_as_the_torch_transforms_do() -> None:
    config = SAM_CONFIGS["vit_tiny"]
    stages = SamStages(
        load_sam(config, None, seed=0), config, torch.device("cpu"), OptimizeOptions(), [1], [1]
    )
    rng = np.random.default_rng(0)
    for _ in range(500):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        n = int(rng.integers(0, 4))
        points = tuple(
            (float(rng.uniform(-99, w + 99)), float(rng.uniform(-99, h + 99))) for _ in range(n)
        )
        box = (
            None
            if rng.random() < 0.3
            else tuple(float(v) for v in rng.uniform(-99, max(h, w) + 99, 4))
        )
        prompt = Prompt(points=points, labels=tuple(int(v) for v in rng.integers(0, 2, n)), box=box)
        input_size = sam_tf.resize_longest_side_size(h, w, config.image_size)
        entry = ImageEmbedding("img", torch.zeros(1), input_size, (h, w))
        got = stages._prompt_set(prompt, entry, None)
        want_points, want_box = reference(prompt, (h, w))
        assert isinstance(got.points, np.ndarray) and got.points.dtype == np.float32
        assert np.array_equal(got.points, want_points.numpy())
        assert np.array_equal(np.asarray(got.labels), np.asarray(prompt.labels, dtype=np.int64))
        if box is None:
            assert got.box is None
        else:
            assert np.array_equal(np.asarray(got.box), want_box.numpy())


def test_full_size_masks_made_in_slices_are_the_masks_made_at_once() -> None:
    """Many prompts on a large image are upscaled a slice of prompts at a time (within
    `work_bytes`): the masks, their order and scores are the same as made in one go."""
    config = SAM_CONFIGS["vit_tiny"]
    model = load_sam(config, None, seed=0)
    cpu = torch.device("cpu")
    whole = SamStages(model, config, cpu, OptimizeOptions(), [1], [1, 8])
    sliced = SamStages(model, config, cpu, OptimizeOptions(), [1], [1, 8], work_bytes=1)
    assert sliced._slice_prompts(3, (300, 400)) == 1 and whole._slice_prompts(3, (300, 400)) > 5
    pixels = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (300, 400, 3), np.uint8))
    (entry,) = whole.encode([EncodeItem("img", pixels)])
    prompts = tuple(Prompt(box=(10.0 * k, 5.0 * k, 200.0 + 20 * k, 250.0)) for k in range(5))
    items = [DecodeItem(entry, prompts, multimask=True), DecodeItem(entry, prompts[:2], False)]
    for want, got in zip(whole.decode(items), sliced.decode(items), strict=True):
        for a, b in zip(want, got, strict=True):
            assert a.masks is not None and b.masks is not None and a.masks.shape[1:] == (300, 400)
            assert np.array_equal(a.masks, b.masks)
            assert np.array_equal(a.scores, b.scores)


def test_a_batch_of_requests_on_several_images_gets_what_each_gets_alone() -> None:
    """The decoder's post-processing groups the requests of a batch by image size (one
    upscale per group) and sorts masks while still low-res: from the same decoder outputs,
    each request's masks, runs, scores and kept low-res logits are exactly those its own
    post-processing makes."""
    config = SAM_CONFIGS["vit_tiny"]
    model = load_sam(config, None, seed=0)
    stages = SamStages(model, config, torch.device("cpu"), OptimizeOptions(), [1], [1, 8],
                       rle_on_device=True)  # fmt: skip
    rng = np.random.default_rng(3)
    sizes = [(300, 400), (200, 120), (300, 400)]
    entries = [
        stages.encode([EncodeItem(f"img{n}", torch.from_numpy(rng.integers(0, 256, (*s, 3),
                                                                           np.uint8)))])[0]
        for n, s in enumerate(sizes)
    ]  # fmt: skip
    click = Prompt(points=((50.0, 60.0),), labels=(1,))
    box = Prompt(box=(10.0, 20.0, 110.0, 150.0))
    items = [
        DecodeItem(entries[0], (click, box), multimask=True, return_low_res=True),
        DecodeItem(entries[1], (box,), multimask=False, output="png"),
        DecodeItem(entries[2], (click,), multimask=True, output="rle"),
        DecodeItem(entries[0], (box,), multimask=False, return_low_res=True),
    ]
    # one decoder run for the batch (a batched GEMM rounds differently than a lone one)
    sets = [stages._prompt_set(p, i.embedding, None) for i in items for p in i.prompts]
    embeddings = [i.embedding.embedding for i in items for _ in i.prompts]
    low_res, iou = stages._run_decoder(embeddings, sets)
    together = stages._postprocess(items, low_res, iou)
    start = 0
    for item, got in zip(items, together, strict=True):
        rows = slice(start, start + len(item.prompts))
        start = rows.stop
        (alone,) = stages._postprocess([item], low_res[rows], iou[rows])
        assert len(got) == len(alone) == len(item.prompts)
        for a, b in zip(alone, got, strict=True):
            assert np.array_equal(a.scores, b.scores)
            if item.output == "png":
                assert a.masks is not None and b.masks is not None
                assert b.masks.shape[1:] == item.embedding.original_size
                assert np.array_equal(a.masks, b.masks)
            else:
                assert a.runs is not None and b.runs is not None
                assert b.runs.size == item.embedding.original_size
                assert all(np.array_equal(x, y) for x, y in zip(a.runs.counts, b.runs.counts,
                                                                strict=True))  # fmt: skip
                assert np.array_equal(a.runs.areas, b.runs.areas)
                assert np.array_equal(a.runs.boxes, b.runs.boxes)
            if item.return_low_res:
                assert a.low_res is not None and b.low_res is not None
                assert torch.equal(a.low_res, b.low_res)
            else:
                assert b.low_res is None
