"""COCO RLE made from device-side runs equals pycocotools' encoding, byte for byte; and a
server that makes RLE on the device answers exactly what the host path answers."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pycocotools import mask as mask_utils

from server.engine.runs import mask_runs
from server.rle import counts_string


def reference(mask: np.ndarray) -> dict:
    return mask_utils.encode(np.asfortranarray(mask[:, :, None].astype(np.uint8)))[0]


def smooth(h: int, w: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(1, 1, 8, 8, generator=g)
    return (F.interpolate(low, (h, w), mode="bilinear", align_corners=False)[0, 0] > 0).numpy()


def stacks() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    noise = rng.random((3, 40, 30)) > 0.5
    corners = np.zeros((4, 6, 6), bool)
    corners[0, 0, 0] = corners[1, 5, 5] = corners[2, 0, 5] = True  # [3] stays empty
    full = np.ones((2, 5, 7), bool)
    full[1] = False
    lines = [rng.random((2, 1, 50)) > 0.3, rng.random((2, 50, 1)) > 0.3]
    photo_like = np.stack([smooth(534, 800, s) for s in range(2)])
    return [noise, corners, full, *lines, photo_like]


def test_counts_match_pycocotools_in_one_batch():
    batch = stacks()
    runs = mask_runs([torch.from_numpy(s) for s in batch])
    assert len(runs) == len(batch)
    for stack, got in zip(batch, runs, strict=True):
        assert got.size == stack.shape[1:]
        for k in range(stack.shape[0]):
            ref = reference(stack[k])
            assert got.rle(k)["counts"] == ref["counts"].decode()
            assert got.areas[k] == mask_utils.area(ref)
            np.testing.assert_allclose(got.boxes[k], mask_utils.toBbox(ref))
            decoded = mask_utils.decode({"size": list(stack.shape[1:]), "counts": ref["counts"]})
            assert (decoded.astype(bool) == stack[k]).all()


def test_counts_cross_in_the_narrowest_type_that_holds_the_batch_s_runs():
    """A noise mask's runs are short: uint16 takes a quarter of int64's bytes on their way to
    a frontend. A run of 65,536 or more makes the whole batch uint32."""
    rng = np.random.default_rng(1)
    noise = torch.from_numpy(rng.random((2, 200, 300)) > 0.5)
    short = mask_runs([noise])
    assert all(c.dtype == np.uint16 for c in short[0].counts)
    empty = torch.zeros(1, 300, 300, dtype=torch.bool)  # one run of 90,000 zeros
    full = torch.ones(1, 300, 300, dtype=torch.bool)  # a run of none, then 90,000 ones
    wide = mask_runs([noise, empty, full])
    assert all(c.dtype == np.uint32 for r in wide for c in r.counts)
    assert list(wide[1].counts[0]) == [90_000] and list(wide[2].counts[0]) == [0, 90_000]
    for masks, runs in ((noise, short[0]), (noise, wide[0]), (empty, wide[1]), (full, wide[2])):
        for k in range(masks.shape[0]):
            assert runs.rle(k)["counts"] == reference(masks[k].numpy())["counts"].decode()


def test_empty_stacks_give_no_runs():
    empty = torch.zeros(0, 12, 9, dtype=torch.bool)
    one = torch.ones(1, 4, 4, dtype=torch.bool)
    runs = mask_runs([empty, one, empty])
    assert [len(r) for r in runs] == [0, 1, 0]
    assert runs[0].size == (12, 9)
    assert runs[1].rle(0)["counts"] == reference(np.ones((4, 4), bool))["counts"].decode()
    assert mask_runs([]) == []
    (alone,) = mask_runs([empty])
    assert len(alone) == 0 and alone.areas.shape == (0,)


@pytest.mark.parametrize("counts", [[0], [5], [0, 3, 2], [1, 2, 3, 4, 5], [70000, 1, 2**31 - 5]])
def test_counts_string_matches_for_extreme_counts(counts):
    # a mask of one column whose runs are `counts`
    if sum(counts) > 10_000_000:  # too big to build: compare with a run list pycocotools reads
        rle = {"size": [sum(counts), 1], "counts": counts_string(np.asarray(counts))}
        assert mask_utils.area(rle) == sum(counts[1::2])
        return
    column = np.concatenate([np.full(c, i % 2, np.uint8) for i, c in enumerate(counts)])
    ref = reference(column[:, None].astype(bool))
    assert counts_string(np.asarray(counts)) == ref["counts"].decode()


def test_device_rle_server_answers_like_the_host_path(make_server, client, jpeg_bytes):
    device_rle = make_server(enable_swin=False, mask_rle="device")
    body = {
        "image": base64.b64encode(jpeg_bytes).decode(),
        "boxes": [[10, 10, 200, 150], [50, 60, 300, 230]],
        "multimask_output": True,
    }
    host = client.post("/v1/segment", json=body)
    with httpx.Client(base_url=device_rle.url, timeout=60) as c:
        device = c.post("/v1/segment", json=body)
        everything = {"image": body["image"], "points_per_side": 6,
                      "pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}  # fmt: skip
        dev_all = c.post("/v1/segment/everything", json=everything)
        # Meta's default thresholds keep no mask of random weights: an empty answer
        none = c.post("/v1/segment/everything", json={"image": body["image"], "points_per_side": 4})
        assert none.status_code == 200, none.text
        assert none.json()["masks"] == []
    host_all = client.post("/v1/segment/everything", json=everything)
    assert host.status_code == device.status_code == 200, (host.text, device.text)
    assert device.json()["results"] == host.json()["results"]
    assert dev_all.status_code == host_all.status_code == 200
    assert dev_all.json()["masks"] == host_all.json()["masks"]


def test_mask_runs_as_strings_answer_as_the_run_lengths_do():
    """Masks whose COCO strings were written on the device (SERVE_MASK_STRINGS) give the
    frontend nothing to write: the same mask objects as their run lengths, sliced alike."""
    from server.http.masks import build_mask_objects
    from server.rle import MaskRuns

    masks = torch.from_numpy(np.stack(stacks()[0]))  # three noise masks
    (runs,) = mask_runs([masks])
    assert runs.counts is not None
    written = MaskRuns(runs.size, None, runs.areas, runs.boxes,
                       [counts_string(c) for c in runs.counts])  # fmt: skip
    scores = np.asarray([0.9, 0.5, 0.1])
    assert build_mask_objects(scores, "rle", runs=written) == build_mask_objects(
        scores, "rle", runs=runs
    )
    assert written.runs == 0 and runs.runs == sum(len(c) for c in runs.counts) > 1000
    part = written.select(1, 3)
    assert len(part) == 2 and part.strings == written.strings[1:3]
    assert part.rle(0) == runs.rle(1)
    with pytest.raises(ValueError, match="either"):
        MaskRuns(runs.size, runs.counts, runs.areas, runs.boxes, written.strings)
    with pytest.raises(ValueError, match="either"):
        MaskRuns(runs.size, None, runs.areas, runs.boxes)


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"mask_rle": "low_res"}, "SERVE_MASK_RLE=low_res: its Triton kernel runs on CUDA only"),
        ({"mask_strings": "device"}, "SERVE_MASK_STRINGS=device: the strings are written"),
        ({"mask_rle": "device", "mask_strings": "device"}, "need SERVE_MASK_RLE=low_res"),
    ],
)
def test_device_runs_and_strings_the_cpu_cannot_make_are_refused_at_start(setting, says):
    from server.engine.services import Engine
    from tests.server.conftest import small_settings

    with pytest.raises(ValueError, match=says):
        Engine(small_settings(**setting))


def test_the_cpu_writes_strings_on_the_host():
    from server.engine.services import Engine
    from tests.server.conftest import small_settings

    engine = Engine(small_settings())
    try:
        assert not engine.rle_from_low_res and not engine.strings_on_device
    finally:
        asyncio.run(engine.close())
