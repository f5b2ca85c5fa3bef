"""bench/jpeg_decode.py's CPU smoke: the host rows measure every photo they say they did,
and `--photos passed` keeps exactly the files a frontend would pass to the engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.common import DEFAULT_IMAGES
from bench.jpeg_decode import SAM, SWIN, main, preprocessed, read_jpegs
from server.http import jpeg_pass
from server.imaging import decode_image
from tests.conftest import PHOTOS

SHARED_PHOTOS = DEFAULT_IMAGES
LIMITS = {"max_pixels": 10**8, "max_bytes": 10**8}


def test_host_rows_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    payload = main(["--device", "cpu", "--images", str(PHOTOS), "--seconds", "0.2",
                    "--rules", "swin", "whole", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == payload["rows"]
    rows = {row["rule"]: row for row in payload["rows"]}
    assert set(rows) == {"swin", "whole"} and {r["path"] for r in rows.values()} == {"host"}
    for row in rows.values():
        assert row["images"] % 3 == 0 and row["images"] >= 3  # whole rounds of the 3 photos
        assert row["img_per_s"] > 0 and row["cpu_ms_per_img"] > 0
    assert "fidelity" not in payload  # nvJPEG's comparison needs CUDA


def test_passed_photos_are_the_upright_baseline_ones() -> None:
    every = read_jpegs(SHARED_PHOTOS, "all")
    passed = read_jpegs(SHARED_PHOTOS, "passed")
    progressive = {n for n, d in every if jpeg_pass.frame_marker(d) == 0xC2}
    assert progressive and {n for n, _ in passed} == {n for n, _ in every} - progressive


def test_the_gpu_rows_preprocess_as_the_models_do() -> None:
    """What follows each nvJPEG decode in the rows: the models' own transforms (run here
    on the CPU; the decode itself needs CUDA)."""
    image = torch.from_numpy(decode_image((PHOTOS / "truck.jpg").read_bytes(), **LIMITS).pixels)
    assert tuple(preprocessed(image, "sam").shape) == (1, 3, SAM.image_size, SAM.image_size)
    assert tuple(preprocessed(image, "swin").shape) == (1, 3, SWIN.img_size, SWIN.img_size)
    assert preprocessed(image, "whole") is image
