"""The test-only torchvision stand-in (tests/_stubs): NMS semantics equal torchvision's.

The stub is loaded from its own folder, so these tests check it even where a real
torchvision is installed (then its results are also compared with the real one).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch import Tensor

STUB = Path(__file__).resolve().parents[1] / "_stubs" / "torchvision"


def _load(relative: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, STUB / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def boxes_ops() -> ModuleType:
    return _load("ops/boxes.py", "_stub_torchvision_boxes")


def _reference_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, threshold: float) -> list[int]:
    """Greedy NMS written out literally: highest score first, per category."""
    box, score, category = boxes.tolist(), scores.tolist(), idxs.tolist()
    area = [(b[2] - b[0]) * (b[3] - b[1]) for b in box]
    kept: list[int] = []
    for i in sorted(range(len(score)), key=lambda i: (-score[i], i)):
        suppressed = False
        for j in kept:
            if category[i] != category[j]:
                continue
            w = min(box[i][2], box[j][2]) - max(box[i][0], box[j][0])
            h = min(box[i][3], box[j][3]) - max(box[i][1], box[j][1])
            inter = max(0.0, w) * max(0.0, h)
            if inter / (area[i] + area[j] - inter) > threshold:
                suppressed = True
                break
        if not suppressed:
            kept.append(i)
    return kept


def _random_boxes(n: int, categories: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 200
    boxes = torch.cat([xy, xy + 5 + torch.rand(n, 2, generator=g) * 60], dim=1)
    scores = torch.rand(n, generator=g)
    return boxes, scores, torch.randint(0, categories, (n,), generator=g)


# 60 boxes take torchvision's coordinate-offset path, 1200 its per-category path
@pytest.mark.parametrize(("n", "categories"), [(60, 3), (1200, 4)])
@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_batched_nms_matches_literal_greedy(boxes_ops, n: int, categories: int, threshold) -> None:
    boxes, scores, idxs = _random_boxes(n, categories, seed=n)
    keep = boxes_ops.batched_nms(boxes, scores, idxs, threshold)
    assert keep.dtype == torch.int64
    assert keep.tolist() == _reference_nms(boxes, scores, idxs, threshold)
    assert bool((scores[keep][1:] <= scores[keep][:-1]).all())
    try:
        from torchvision.ops import boxes as real  # the real package, where installed
    except ImportError:
        return
    if not getattr(importlib.import_module("torchvision"), "IS_TEST_STUB", False):
        assert keep.tolist() == real.batched_nms(boxes, scores, idxs, threshold).tolist()


def test_box_area_and_empty_input(boxes_ops) -> None:
    boxes = torch.tensor([[0.0, 0.0, 2.0, 3.0], [1.0, 1.0, 1.0, 5.0]])
    assert boxes_ops.box_area(boxes).tolist() == [6.0, 0.0]
    empty = boxes_ops.batched_nms(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0), 0.5)
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_resize_semantics() -> None:
    functional = _load("transforms/functional.py", "_stub_torchvision_functional")
    array = np.zeros((30, 40, 3), dtype=np.uint8)
    image = functional.to_pil_image(array)
    assert image.size == (40, 30)
    assert functional.resize(image, (15, 20)).size == (20, 15)  # (h, w) in, PIL (w, h) out
    assert functional.resize(image, 15).size == (20, 15)  # int: the shorter side
