"""bench/jpeg_decode.py's CPU smoke: the host rows measure every photo they say they did,
and `--photos passed` keeps exactly the files a frontend would pass to the engine."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import DEFAULT_IMAGES
from bench.jpeg_decode import main, read_jpegs
from server.http import jpeg_pass
from tests.conftest import PHOTOS

SHARED_PHOTOS = DEFAULT_IMAGES


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
