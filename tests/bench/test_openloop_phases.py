"""bench/openloop/phases.py: each request's latency split by hop, from the `timing_ms` its
response carried, and the report's percentiles of each part: the arithmetic on a made-up
request, then on requests recorded from a short run against a real server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench.openloop import phases, report
from bench.openloop.worker import StepSpec, run_step
from bench.service_load import load_images
from tests.server.conftest import LiveServer

SLACK_MS = 0.02  # each server entry is rounded to a microsecond on its own


def test_parts_of_one_request_are_the_remainders_between_nested_hops() -> None:
    timing = {
        "parse_and_decode": 0.5, "encode": 0.1, "decode": 2.5, "decode_queue": 1.0,
        "engine_rpc": 4.0, "engine_wire": 3.5, "engine": 3.0, "mask_encode": 0.3,
        "total": 4.9, "frontend": 5.0,
    }  # fmt: skip
    parts = phases.parts_of(9.0, 1.0, timing)
    assert parts["lag"] == 1.0
    assert parts["unaccounted"] == pytest.approx(4.0)  # 9 - frontend
    assert parts["http"] == pytest.approx(3.0)  # 9 - lag - frontend
    assert parts["frontend_other"] == pytest.approx(0.2)  # 5 - 0.5 - 4 - 0.3
    assert parts["rpc_loop"] == pytest.approx(0.5)
    assert parts["rpc_transport"] == pytest.approx(0.5)
    assert parts["engine_other"] == pytest.approx(0.4)  # 3 - 0.1 - 2.5
    assert parts["decode_queue"] == 1.0 and "wire_other" not in parts
    # without the engine's own time: what lies between the wire and the phases, as one
    older = {k: v for k, v in timing.items() if k != "engine"}
    parts = phases.parts_of(9.0, 1.0, older)
    assert parts["wire_other"] == pytest.approx(0.9)  # 3.5 - 0.1 - 2.5
    assert not {"engine", "rpc_transport", "engine_other"} & parts.keys()
    # a response with only some entries: no remainder made of missing ones
    assert phases.parts_of(3.0, 0.5, {"total": 2.0}) == {"lag": 0.5}


def test_timing_of_reads_the_last_top_level_entry() -> None:
    body = {"results": [{"masks": [{"counts": "PZ3d0;E`0Q1"}]}], "timing_ms": {"a": 1, "b": 2.5}}
    assert phases.timing_of(json.dumps(body).encode()) == {"a": 1.0, "b": 2.5}  # with spaces
    compact = json.dumps(body, separators=(",", ":")).encode()
    assert phases.timing_of(compact) == {"a": 1.0, "b": 2.5}
    assert phases.timing_of(b'{"predictions": []}') is None
    assert phases.timing_of(b'{"timing_ms": [1, 2]}') is None
    assert phases.timing_of(b'{"timing_ms": {"a": ') is None  # cut short
    assert phases.timing_of(b'{"timing_ms": {"a": 1, "b": true, "c": "x"}}') == {"a": 1.0}


def test_the_report_breaks_recorded_requests_down_by_hop(
    live_server: LiveServer, small_jpeg_dir: Path
) -> None:
    """A short run of the three kinds against a real server: every 200 brought its
    timing_ms back; per request the parts add up to the client's latency and none is
    negative; the row's percentiles are those of the recorded parts; both tables print."""
    images = load_images(small_jpeg_dir)
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        ids = tuple(
            c.post("/v1/embed", files={"image": (n, d, "image/jpeg")}).json()["image_id"]
            for n, d, _, _ in images
        )
    rates = (("segment", 3.0), ("click", 8.0), ("classify", 3.0))
    spec = StepSpec(
        url=live_server.url, rates=rates, seconds=2.0, warmup_s=0.0, timeout_s=30.0,
        processes=1, seed=3, nonce="phases", images=images, image_ids=ids,
    )  # fmt: skip
    samples = run_step(spec, None, lead_in_s=0.1)
    ok = [s for s in samples if s.status == "200"]
    assert len(ok) == len(samples) >= 8, samples
    engine_says = all(s.timing_ms is not None and "engine" in s.timing_ms for s in ok)
    for s in ok:
        assert s.timing_ms is not None and {"frontend", "engine_rpc"} <= s.timing_ms.keys()
        parts = phases.parts_of(s.latency_s * 1000, s.lag_s * 1000, s.timing_ms)
        # the client's latency is its lag, the HTTP hop and the frontend's time
        assert parts["lag"] + parts["http"] + parts["frontend"] == pytest.approx(
            s.latency_s * 1000, abs=1e-6
        )
        assert parts["unaccounted"] >= parts["http"] >= 0, parts
        for name in ("frontend_other", "rpc_loop", "rpc_transport", "engine_other", "wire_other"):
            assert parts.get(name, 0.0) >= -SLACK_MS * 4, (name, parts)
    rows = {kind: report.summarize(samples, "mix", kind, rate, 0.0, 2.0) for kind, rate in rates}
    for kind, row in rows.items():
        mine = [s for s in ok if s.kind == kind]
        assert row["ok"] == len(mine) >= 1, row
        q = row["phases_ms"]
        expected = {"lag", "unaccounted", "http", "frontend", "parse_and_decode", "engine_rpc",
                    "engine_wire", "frontend_other", "rpc_loop"}  # fmt: skip
        expected |= {"engine", "rpc_transport", "engine_other"} if engine_says else {"wire_other"}
        expected |= {"classify", "classify_queue"} if kind == "classify" else {
            "encode", "decode", "decode_queue", "mask_encode"}  # fmt: skip
        assert expected <= q.keys(), (kind, sorted(q))
        assert all(q[name]["n"] == len(mine) for name in expected - {"encode_queue"}), q
        frontends = sorted(s.timing_ms["frontend"] for s in mine if s.timing_ms)
        assert q["frontend"]["p50"] == report.percentile(frontends, 50)
        assert q["frontend"]["p99"] == frontends[-1 if len(frontends) < 100 else -2]
        https = sorted(
            phases.parts_of(s.latency_s * 1000, s.lag_s * 1000, s.timing_ms or {})["http"]
            for s in mine
        )
        assert q["http"]["p99"] == round(report.percentile(https, 99), 3)
        assert q["unaccounted"]["p50"] >= 0 and q["lag"]["p50"] <= q["lag"]["p99"]
    # a clicked photo's embedding is cached: its encoder never queued
    assert "encode_queue" not in rows["click"]["phases_ms"]
    assert rows["segment"]["phases_ms"]["encode_queue"]["n"] >= 1
    text = report.phase_table(list(rows.values())).splitlines()
    assert text[2].startswith("| step | kind | lag | unacc | http | frontend | parse |")
    assert len(text) == 4 + 3 and all(line.count("/") >= 10 for line in text[4:]), text
    assert "| mix | click |" in text[5]
