"""`bench.stage_times`: each stage's batches between two scrapes of a live server's
`/metrics`, with their wall time and (on CUDA) their GPU span."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench import stage_times
from tests.server.conftest import LiveServer, encode, photo_like


def test_the_batches_of_a_step_are_counted_per_stage(
    live_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tmp_path / "before.json"
    assert stage_times.main(["--url", live_server.url, "--save", str(before)]) == 0
    # a size no other test sends: the server may be shared, and a cached embedding would
    # skip the encoder
    photo = {"image": ("p.jpg", encode(photo_like(173, 129)), "image/jpeg")}
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        for _ in range(2):
            assert c.post("/v1/classify", files=photo).status_code == 200
        box = {"request": '{"box": [10, 10, 100, 90]}'}
        assert c.post("/v1/segment", files=photo, data=box).status_code == 200
    capsys.readouterr()
    assert stage_times.main(["--url", live_server.url, "--since", str(before),
                             "--title", "after the step"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after the step"
    assert lines[1] == "| " + " | ".join(stage_times.COLUMNS) + " |"
    table = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in lines[3:]
    )}  # fmt: skip
    # two classifications (maybe one batch), an encoding and a decoding; no other stage
    assert set(table) == {"swin", "sam_encoder", "sam_decoder"}, table
    assert 1 <= int(table["swin"][0]) <= 2
    assert int(table["sam_encoder"][0]) == int(table["sam_decoder"][0]) == 1
    for _, wall_ms, gpu_ms, _ in table.values():
        assert float(wall_ms) > 0
        assert gpu_ms == "-"  # no CUDA stream here: no span
    # the items each engine's stage took (one engine here): one image encoded, one decoded
    for stage in ("sam_encoder", "sam_decoder"):
        engine, items = table[stage][3].split(":")
        assert (engine.isdigit() or engine == "-") and int(items) == 1, table[stage]


def test_rows_take_the_difference_and_skip_idle_stages() -> None:
    then = {"swin": {"batches": 2.0, "wall_s": 0.02, "spans": 2.0, "gpu_s": 0.01,
                     "items engine 0": 5.0}}  # fmt: skip
    now = {
        "swin": {
            "batches": 6.0,
            "wall_s": 0.10,
            "spans": 6.0,
            "gpu_s": 0.03,
            "items engine 0": 9.0,
            "items engine 1": 7.0,
        },
        "sam_encoder": {"batches": 0.0, "wall_s": 0.0, "spans": 0.0, "gpu_s": 0.0},
    }
    (row,) = stage_times.rows(then, now)
    assert row["stage"] == "swin" and row["batches"] == 4
    assert row["wall ms, mean"] == pytest.approx(20.0)
    assert row["gpu span ms, mean"] == pytest.approx(5.0)
    assert row["items by engine"] == "0:4 1:7"
