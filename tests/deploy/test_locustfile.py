"""loadtest/locustfile.py without a server: the load profile and the response checks.

The checks must reject what breaks the contract, or a green load test would prove nothing.
The module is imported with LOCUST_SKIP_MONKEY_PATCH so gevent does not patch this pytest
process (other tests here run real threads).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as mask_utils

from tests.deploy.conftest import REPO

LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


@pytest.fixture(scope="module")
def lf() -> Iterator[ModuleType]:
    name = "sam_swin_locustfile"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCUST_SKIP_MONKEY_PATCH", "1")
        spec = importlib.util.spec_from_file_location(name, LOCUSTFILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        mp.setitem(sys.modules, name, module)  # dataclasses resolve annotations through it
        spec.loader.exec_module(module)
        yield module


def test_stage_list_accumulates_durations(lf):
    stages = lf.parse_stages("30s:4, 2m:8:2, 1m:40, 90:0")
    assert stages == [
        lf.Stage(30.0, 4, 1.0),
        lf.Stage(150.0, 8, 2.0),
        lf.Stage(210.0, 40, 3.2),  # without a rate: the change in ~10 s
        lf.Stage(300.0, 0, 4.0),
    ]
    ramp = lf.parse_stages("ramp")
    assert [s.users for s in ramp] == [4, 16, 32, 64, 8]
    assert lf.parse_stages("") == []


@pytest.mark.parametrize("bad", ["4", "30x:4", "30s:-1", "30s:4:0", "1m:4:2:3"])
def test_bad_stages_are_refused(lf, bad):
    with pytest.raises(ValueError):
        lf.parse_stages(bad)


def test_shape_follows_the_stages_then_stops(lf, monkeypatch):
    monkeypatch.setenv("LOADTEST_STAGES", "10s:2,10s:6:3")
    shape = lf.RampShape()
    assert shape.tick() == (2, 1.0)
    shape.start_time -= 15
    assert shape.tick() == (6, 3.0)
    shape.start_time -= 10
    assert shape.tick() is None


def test_shape_without_stages_is_a_flat_run_of_the_command_line(lf, monkeypatch):
    monkeypatch.delenv("LOADTEST_STAGES", raising=False)
    shape = lf.RampShape()
    options = SimpleNamespace(num_users=4, spawn_rate=2.0)
    shape.runner = SimpleNamespace(environment=SimpleNamespace(parsed_options=options))
    assert shape.tick() == (4, 2.0)


@pytest.mark.parametrize("stages", ["", "1m:4"])
def test_run_time_ends_either_profile(lf, monkeypatch, stages):
    # Locust waits for the shape to end, so -t is only honoured if the shape does it
    monkeypatch.setenv("LOADTEST_STAGES", stages)
    shape = lf.RampShape()
    options = SimpleNamespace(num_users=4, spawn_rate=4.0, run_time=15)
    shape.runner = SimpleNamespace(environment=SimpleNamespace(parsed_options=options))
    assert shape.tick() is not None
    shape.start_time -= 16
    assert shape.tick() is None


def test_photos_are_read_oriented_with_their_sha256(lf, monkeypatch, tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the server sees a 30x40 image
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, "JPEG", exif=exif)
    (tmp_path / "a.jpg").write_bytes(buf.getvalue())
    (tmp_path / "notes.txt").write_text("not a photo")
    monkeypatch.setenv("LOADTEST_IMAGES", str(tmp_path))
    lf.photos.cache_clear()
    try:
        (photo,) = lf.photos()
        assert (photo.width, photo.height) == (30, 40)
        assert photo.sha256 == hashlib.sha256(buf.getvalue()).hexdigest()
        monkeypatch.setenv("LOADTEST_IMAGES", str(tmp_path / "empty"))
        lf.photos.cache_clear()
        with pytest.raises(RuntimeError, match=r"no \.jpg"):
            lf.photos()
    finally:
        lf.photos.cache_clear()


# -- content checks ---------------------------------------------------------------------------


def mask_object(mask: np.ndarray, score: float) -> dict[str, Any]:
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {
        "segmentation": {"size": list(mask.shape), "counts": rle["counts"].decode("ascii")},
        "score": score,
        "area": int(mask.sum()),
        "bbox": [float(v) for v in mask_utils.toBbox(rle)],
    }


@pytest.fixture
def photo(lf):
    return lf.Photo("x.jpg", b"bytes", width=48, height=32, sha256="ab" * 32)


@pytest.fixture
def segment_body(photo) -> dict[str, Any]:
    """A correct answer for two boxes, multimask."""
    rng = np.random.default_rng(0)
    results = []
    for _ in range(2):
        masks = [rng.random((photo.height, photo.width)) > 0.5 for _ in range(3)]
        results.append(
            {"masks": [mask_object(m, s) for m, s in zip(masks, (0.9, 0.5, 0.1), strict=True)]}
        )
    return {"image_id": photo.sha256, "width": 48, "height": 32, "results": results}


def test_a_correct_segment_answer_passes(lf, photo, segment_body):
    lf.check_segment(segment_body, photo, photo.sha256, results=2, multimask=True)


def _broken(body: dict[str, Any], how: str) -> dict[str, Any]:
    body = copy.deepcopy(body)
    first = body["results"][0]["masks"]
    if how == "image_id":
        body["image_id"] = "0" * 64
    elif how == "size":
        body["width"] = 47
    elif how == "results":
        body["results"].pop()
    elif how == "unsorted":
        first[0]["score"], first[1]["score"] = first[1]["score"], first[0]["score"]
    elif how == "area":
        first[0]["area"] += 1
    elif how == "rle_size":
        first[0]["segmentation"]["size"] = [31, 48]
    elif how == "mask_count":
        first.pop()
    return body


@pytest.mark.parametrize(
    "how", ["image_id", "size", "results", "unsorted", "area", "rle_size", "mask_count"]
)
def test_a_broken_segment_answer_is_caught(lf, photo, segment_body, how):
    with pytest.raises(lf.ContentError):
        lf.check_segment(_broken(segment_body, how), photo, photo.sha256, 2, True)


def test_embed_and_classify_checks(lf, photo):
    lf.check_embed({"image_id": photo.sha256, "width": 48, "height": 32, "cached": False}, photo)
    with pytest.raises(lf.ContentError):
        lf.check_embed({"image_id": photo.sha256, "width": 48, "height": 32}, photo)
    good = [{"label": f"c{i}", "index": i, "score": s} for i, s in enumerate((0.5, 0.3, 0.2))]
    lf.check_classify({"predictions": good}, 3)
    for bad in (good[:2], list(reversed(good)), [*good[:2], {**good[2], "index": 0}]):
        with pytest.raises(lf.ContentError):
            lf.check_classify({"predictions": bad}, 3)
    with pytest.raises(lf.ContentError):
        lf.check_classify({"predictions": [{**good[0], "score": 3.2}]}, 1)


def test_locustfile_lives_beside_no_photos():
    # real photos come from LOADTEST_IMAGES; none are committed with the load test
    folder = Path(LOCUSTFILE).parent
    assert not [p for p in folder.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"}]
