"""bench/openloop: the schedule arithmetic with fake senders (a stalled loop, a slow
server), the report's exact percentiles, the requests it builds, and the tool itself against
real servers: a clean mix through its command line, then refusals counted by status."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.openloop import report
from bench.openloop.__main__ import main as openloop_main
from bench.openloop.kinds import RequestMaker, click_copy, random_box, random_points, unique_jpeg
from bench.openloop.pools import SHARD, ShardedPools
from bench.openloop.schedule import (
    Outcome,
    Sample,
    arrivals,
    poisson_schedule,
    run_open_loop,
)
from bench.openloop.worker import StepSpec, run_step
from bench.service_load import load_images
from server.http import jpeg_pass
from server.http.multipart import boundary_of, read_form
from server.imaging import decode_image, heap_pixels
from tests.server.conftest import ROOT, LiveServer, free_port

# -- the schedule ----------------------------------------------------------------------


def test_poisson_schedule_has_the_rate_and_is_seeded() -> None:
    times = poisson_schedule(200.0, 50.0, random.Random(1))
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 50.0
    assert abs(len(times) - 10_000) < 400, len(times)  # 4 standard deviations
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(sum(gaps) / len(gaps) - 1 / 200) < 0.0002
    # exponential gaps: about 1/e of them are longer than the mean
    assert abs(sum(g > 1 / 200 for g in gaps) / len(gaps) - 0.3679) < 0.02
    assert poisson_schedule(200.0, 50.0, random.Random(1)) == times
    assert poisson_schedule(200.0, 50.0, random.Random(2)) != times
    assert poisson_schedule(0.0, 10.0, random.Random(1)) == []
    with pytest.raises(ValueError):
        poisson_schedule(-1.0, 10.0, random.Random(1))


def test_arrivals_merge_kinds_each_on_its_own_schedule() -> None:
    def rng_for(kind: str) -> random.Random:
        return random.Random(kind)

    alone = arrivals({"click": 50.0}, 4.0, rng_for)
    mixed = arrivals({"segment": 20.0, "click": 50.0}, 4.0, rng_for)
    assert mixed == sorted(mixed)
    assert [a for a in mixed if a[1] == "click"] == alone  # adding a kind changes no other
    assert 40 <= sum(1 for a in mixed if a[1] == "segment") <= 120


def test_latency_counts_from_the_scheduled_time_when_the_client_stalls() -> None:
    """The first send blocks the event loop for 0.3 s (a stalled client): the requests due
    meanwhile go out late, and their latency includes the wait, down to their schedule."""
    schedule = [(k * 0.05, "segment") for k in range(20)]  # 0.00, 0.05, ... 0.95

    async def stalling(kind: str, seq: int) -> Outcome:
        sent = asyncio.get_running_loop().time()
        if seq == 0:
            time.sleep(0.3)  # blocks the whole loop, as a busy client process would
        return Outcome("200", 10, sent)

    async def go() -> list[Sample]:
        return await run_open_loop(schedule, stalling, asyncio.get_running_loop().time())

    samples = asyncio.run(go())
    assert [s.scheduled_s for s in samples] == pytest.approx([t for t, _ in schedule], abs=1e-9)
    assert samples[0].latency_s >= 0.3
    for s in samples[1:6]:  # due at 0.05 .. 0.25, inside the stall: sent at 0.3 at the earliest
        assert s.lag_s >= 0.3 - s.scheduled_s - 0.005, s
        assert s.latency_s >= 0.3 - s.scheduled_s - 0.005, s
    # due well after the stall: on time again. The median, so that one pause of a loaded
    # machine (0.28 s once, on two busy cores) is not taken for a loop that never recovered,
    # whose every request would still be about 0.3 s late
    after = [s.lag_s for s in samples if s.scheduled_s >= 0.5]
    assert statistics.median(after) < 0.1, after


def test_requests_go_out_on_schedule_while_earlier_ones_are_still_waiting() -> None:
    """A slow server (0.2 s each): an open loop sends the next request on time anyway, so
    ten requests 20 ms apart take about 0.38 s, not ten times 0.2 s."""
    schedule = [(k * 0.02, "click") for k in range(10)]
    in_flight, most = 0, 0

    async def slow(kind: str, seq: int) -> Outcome:
        nonlocal in_flight, most
        sent = asyncio.get_running_loop().time()
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1
        return Outcome("200", 1, sent)

    async def go() -> tuple[list[Sample], float]:
        start = asyncio.get_running_loop().time()
        samples = await run_open_loop(schedule, slow, start)
        return samples, asyncio.get_running_loop().time() - start

    samples, elapsed = asyncio.run(go())
    assert elapsed < 1.0, elapsed
    assert most >= 8, most
    assert all(0.2 <= s.latency_s < 0.4 for s in samples), samples
    assert all(s.lag_s < 0.1 for s in samples), samples


def test_a_sender_that_raises_is_counted_by_its_exception() -> None:
    async def broken(kind: str, seq: int) -> Outcome:
        await asyncio.sleep(0.05)
        raise RuntimeError("a bug in a sender")

    async def go() -> list[Sample]:
        return await run_open_loop([(0.0, "classify")], broken, asyncio.get_running_loop().time())

    [failed] = asyncio.run(go())
    assert failed.status == "error:RuntimeError" and failed.nbytes == 0
    assert failed.lag_s == failed.latency_s >= 0.05  # never went out: waited all along


def test_the_pools_cap_requests_in_flight_and_spread_them_over_small_pools() -> None:
    """70 slots in pools of at most 32 connections: 70 requests get a connection at once,
    spread over every pool to its size; the 71st waits for one to be handed back."""

    async def go() -> None:
        pools = ShardedPools("http://127.0.0.1:9", 70, 1.0, {})
        assert pools.sizes == [SHARD, SHARD, 70 - 2 * SHARD]
        held: list[int] = []
        release = asyncio.Event()

        async def hold() -> None:
            async with pools.slot() as sender:
                held.append(pools.clients.index(sender.client))
                await release.wait()

        tasks = [asyncio.create_task(hold()) for _ in range(71)]
        await asyncio.sleep(0.05)
        assert len(held) == 70
        assert sorted(Counter(held).values()) == sorted(pools.sizes)
        release.set()
        await asyncio.gather(*tasks)
        assert len(held) == 71
        one = []
        for _ in range(5):  # a light load keeps to the connection on top
            async with pools.slot() as sender:
                one.append(sender.client)
        assert len(set(map(id, one))) == 1
        await pools.aclose()

    asyncio.run(go())


# -- the report ------------------------------------------------------------------------


def sample(t: float, latency: float, status: str = "200", kind: str = "segment") -> Sample:
    return Sample(kind, t, latency, 0.001, status, 100 if status == "200" else 30)


def test_percentiles_are_nearest_rank_over_every_process_samples() -> None:
    assert report.percentile([float(v) for v in range(1, 101)], 50) == 50
    assert report.percentile([float(v) for v in range(1, 101)], 99) == 99
    assert report.percentile([5.0], 99) == 5.0
    # two processes: one fast, one slow; per-process p50s (10, 1000) average to 505 ms,
    # while the pooled samples' p50 is what a user sees
    fast = [sample(1 + k * 0.01, 0.010) for k in range(90)]
    slow = [sample(1 + k * 0.1, 1.000) for k in range(10)]
    row = report.summarize(fast + slow, "segment@50", "segment", 50, 1.0, 10.0)
    assert row["p50_ms"] == pytest.approx(10.0)
    assert row["p90_ms"] == pytest.approx(10.0)
    assert row["p99_ms"] == pytest.approx(1000.0)
    assert row["max_ms"] == pytest.approx(1000.0)


def test_summarize_counts_the_window_by_schedule_and_throughput_by_completion() -> None:
    samples = [
        sample(0.5, 0.1),  # warm-up: not counted
        sample(0.9, 0.5),  # scheduled in the warm-up, completes in the window: throughput
        sample(1.0, 0.2),
        sample(2.0, 0.4),
        sample(2.5, 0.0, "429"),
        sample(3.0, 5.0, "timeout"),
        sample(3.5, 0.01, "conn_error"),
        sample(3.9, 0.3),  # completes after the window: counted as sent and ok, not in ok/s
        sample(4.0, 0.1),  # after the window
        sample(2.0, 0.05, "200", kind="click"),  # another kind
    ]
    row = report.summarize(samples, "mix", "segment", 2.0, warmup_s=1.0, seconds=3.0)
    assert row["sent"] == 6
    assert row["ok"] == 3
    assert row["errors"] == {"429": 1, "conn_error": 1, "timeout": 1}
    assert row["ok"] + sum(row["errors"].values()) == row["sent"]
    assert row["ok_per_s"] == pytest.approx(3 / 3.0)  # 0.9+0.5, 1.0+0.2, 2.0+0.4
    assert row["max_ms"] == pytest.approx(400.0)
    assert row["mean_bytes"] == 100
    empty = report.summarize(samples, "mix", "classify", 1.0, 1.0, 3.0)
    assert empty["sent"] == 0 and empty["p99_ms"] != empty["p99_ms"]  # NaN
    assert "| mix | classify | 1 | 0 | 0.0 | - |" in report.table([empty])


# -- the requests ----------------------------------------------------------------------


def test_boxes_and_points_lie_inside_the_image() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        w, h = rng.randint(2, 3000), rng.randint(2, 3000)
        x0, y0, x1, y1 = random_box(rng, w, h)
        assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
        coords, labels = random_points(rng, w, h)
        assert 1 <= len(coords) == len(labels) <= 2 and labels[0] == 1
        assert all(0 <= x <= w - 1 and 0 <= y <= h - 1 for x, y in coords)
        assert set(labels) <= {0, 1}


def test_segment_bytes_never_repeat_and_click_names_the_embedding(small_jpeg_dir: Path) -> None:
    images = load_images(small_jpeg_dir)
    ids = tuple(f"id{k}" for k in range(len(images)))
    seen = set()
    for step, process in itertools.product(("run.0", "run.1"), (0, 1)):
        # the same prompts' seed in both steps: only the tail tells their photos apart
        maker = RequestMaker(images, ids, random.Random(process), step, process)
        for seq in range(50):
            r = maker.make("segment", seq)
            # the body as the service's own multipart reader takes it apart
            boundary = boundary_of(r.headers["Content-Type"])
            assert boundary is not None
            parts = {p.name: p for p in read_form(r.body, boundary, max_parts=4) or ()}
            assert parts.keys() == {"request", "image"} and parts["image"].filename
            data = parts["image"].data
            seen.add(hashlib.sha256(data).hexdigest())
            assert r.headers["X-Image-Id"] == hashlib.sha256(data).hexdigest()
            assert json.loads(parts["request"].data).keys() == {"box"}
            click = maker.make("click", seq)
            body = json.loads(click.body)
            assert click.path == "/v1/segment" and body["image_id"] in ids
            assert click.headers["X-Image-Id"] == body["image_id"]
            assert click.headers["Content-Type"] == "application/json"
    assert len(seen) == 200
    with pytest.raises(ValueError, match="EOI"):
        unique_jpeg(b"\x89PNG\r\n\x1a\n", "x")


def test_clicks_spread_over_copies_of_the_photos(small_jpeg_dir: Path) -> None:
    """`--click-images`: image i is a copy of photo i % photos; every copy is clicked on, at
    a point inside its own photo."""
    images = load_images(small_jpeg_dir)
    n = len(images)
    ids = tuple(f"copy{i}" for i in range(3 * n))
    maker = RequestMaker(images, ids, random.Random(5), "run", 0)
    clicked = set()
    for seq in range(60 * n):
        body = json.loads(maker.make("click", seq).body)
        i = ids.index(body["image_id"])
        clicked.add(i)
        _, _, w, h = images[i % n]
        assert all(0 <= x <= w - 1 and 0 <= y <= h - 1 for x, y in body["point_coords"])
    assert clicked == set(range(3 * n))
    with pytest.raises(ValueError, match="every photo"):
        RequestMaker(images, ids[: n - 1], random.Random(5), "run", 0)
    # copy 0 is the photo's own bytes; the others are new files of the same picture
    data = images[0][1]
    copies = [click_copy(data, c) for c in range(3)]
    assert copies[0] == data and len({hashlib.sha256(c).digest() for c in copies}) == 3
    pixels = [decode_image(c, max_pixels=10**8, max_bytes=10**8).pixels for c in copies]
    assert all(np.array_equal(pixels[0], other) for other in pixels[1:])


def test_the_service_decodes_the_tagged_jpeg_as_a_new_image(
    live_server: LiveServer, small_jpeg_dir: Path
) -> None:
    name, data, w, h = load_images(small_jpeg_dir)[0]
    tagged = unique_jpeg(data, "abc:0:1")
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        answers = [
            c.post(
                "/v1/segment",
                files={"image": (name, body, "image/jpeg")},
                data={"request": json.dumps({"box": [2, 2, w / 2, h / 2]})},
            )
            for body in (data, tagged)
        ]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    plain, new = (r.json() for r in answers)
    assert plain["image_id"] == hashlib.sha256(data).hexdigest()
    assert new["image_id"] == hashlib.sha256(tagged).hexdigest() != plain["image_id"]
    assert (new["width"], new["height"]) == (plain["width"], plain["height"]) == (w, h)
    assert new["results"] == plain["results"]  # the same picture: the same masks
    # still a well-formed baseline file: a GPU engine would decode it (server.http.jpeg_pass)
    file = jpeg_pass.for_engine(tagged, max_pixels=10**8, max_bytes=10**8, memory=heap_pixels)
    assert file is not None and (file.width, file.height) == (w, h)
    assert np.array_equal(decode_image(tagged, max_pixels=10**8, max_bytes=10**8).pixels,
                          decode_image(data, max_pixels=10**8, max_bytes=10**8).pixels)  # fmt: skip


# -- the tool against real servers -----------------------------------------------------


def test_the_tool_runs_a_mix_against_the_service(
    live_server: LiveServer, small_jpeg_dir: Path, tmp_path: Path
) -> None:
    """Two client processes, the three kinds at once at a few per second for 2 s: every
    request answered 200 (a generous timeout: this machine's cores are shared), and each
    row's counts and latencies hang together."""
    out = tmp_path / "rows.json"
    rates = {"segment": 4.0, "click": 8.0, "classify": 4.0}
    mix = ",".join(f"{k}={v:g}" for k, v in rates.items())
    cmd = [
        sys.executable, "-m", "bench.openloop", "--url", live_server.url, "--mix", mix,
        "--seconds", "2", "--warmup-seconds", "0.5", "--processes", "2", "--timeout", "30",
        "--images", str(small_jpeg_dir), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    payload = json.loads(out.read_text())
    rows = {r["kind"]: r for r in payload["rows"]}
    assert rows.keys() == rates.keys()
    assert payload["run"]["processes"] == 2
    assert payload["run"]["models"]["models"][0]["device"] == "cpu"
    for kind, row in rows.items():
        assert row["step"] == "mix" and row["offered_rps"] == rates[kind]
        expected = rates[kind] * 2
        assert 0.25 * expected <= row["sent"] <= 2.5 * expected + 4, row  # Poisson, seeded
        assert row["errors"] == {} and row["ok"] == row["sent"], row
        # 200s completed in the window: at most every request sent by its end (the warm-up's
        # included); on a busy 2-core machine many of the window's complete after it
        assert 0 <= row["ok_per_s"] * 2 <= row["sent"] + rates[kind] * 0.5 * 3 + 4, row
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"] < 30_000
        assert row["mean_bytes"] > 100
    assert sum(row["ok_per_s"] for row in rows.values()) > 0
    assert rows["segment"]["mean_bytes"] > rows["classify"]["mean_bytes"]  # masks vs labels
    # where the 200s' time went, from each response's timing_ms (test_openloop_phases.py)
    for row in rows.values():
        hops = row["phases_ms"]
        assert {"lag", "unaccounted", "http", "frontend", "engine_rpc"} <= hops.keys(), hops
        assert hops["frontend"]["n"] == row["ok"] and hops["frontend"]["p50"] > 0, hops
    table, rest = done.stdout.split("\n\n", 1)
    assert table.startswith("| step | kind | offered/s |") and len(table.splitlines()) == 2 + 3
    hops_table = rest.splitlines()
    assert hops_table[0].startswith("p50/p99 ms of each part") and hops_table[1] == ""
    assert hops_table[2].startswith("| step | kind | lag | unacc |")
    assert len(hops_table) == 4 + 3 + 1
    # the cores the load's two processes kept busy: some, and at most both of them
    cpu_line = hops_table[-1]
    assert cpu_line.startswith("client cpu during mix: ") and cpu_line.endswith(" cores")
    assert 0 < float(cpu_line.split()[-2]) <= 2.0 + 0.5
    assert all(0 < row["client_cores"] <= 2.5 for row in rows.values())


def cache_events(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "serve_embedding_cache_events"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_segment_photos_never_hit_the_embedding_cache_across_steps(
    live_server: LiveServer, small_jpeg_dir: Path, tmp_path: Path
) -> None:
    """Two steps in one process, the same rate and kind: every segment request is a cache
    miss (its photo's bytes are new), none a hit."""
    before = cache_events(live_server.url)
    out = tmp_path / "rows.json"
    argv = [
        "--url", live_server.url, "--kind", "segment", "--rates", "4,4", "--seconds", "1.5",
        "--warmup-seconds", "0", "--pause-seconds", "0", "--processes", "1",
        "--images", str(small_jpeg_dir), "--json", str(out),
    ]  # fmt: skip
    assert openloop_main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == ["segment@4", "segment@4"]
    assert all(r["errors"] == {} and r["sent"] >= 1 for r in rows), rows
    after = cache_events(live_server.url)
    assert after.get("hit", 0) == before.get("hit", 0)
    assert after["miss"] - before.get("miss", 0) == sum(r["sent"] for r in rows)


def test_clicks_on_copies_find_their_embeddings(
    live_server: LiveServer, small_jpeg_dir: Path, tmp_path: Path
) -> None:
    """The tool embeds each click image before the step (a cache miss each, a new image_id
    each), and every click on them is answered."""
    photos = len(load_images(small_jpeg_dir))
    before = cache_events(live_server.url)
    out = tmp_path / "rows.json"
    argv = [
        "--url", live_server.url, "--kind", "click", "--rates", "6", "--seconds", "1.5",
        "--warmup-seconds", "0", "--processes", "1", "--click-images", str(2 * photos + 1),
        "--images", str(small_jpeg_dir), "--json", str(out),
    ]  # fmt: skip
    assert openloop_main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["run"]["click_images"] == 2 * photos + 1
    (row,) = payload["rows"]
    assert row["errors"] == {} and row["ok"] == row["sent"] >= 1, row
    after = cache_events(live_server.url)
    # the photos themselves may have been embedded by an earlier test: copies 1 and 2 not
    assert after["miss"] - before.get("miss", 0) >= photos + 1
    assert after["hit"] - before.get("hit", 0) >= row["sent"]


def test_refusals_are_counted_by_status(
    make_server: Callable[..., LiveServer], small_jpeg_dir: Path
) -> None:
    """A server with an API key and a one-item queue whose encoder batches hang 0.5 s: no
    key is 401 every time; with the key some are served and the rest refused with 429;
    a short client timeout counts timeouts; a closed port counts connection errors. Nothing
    is retried, and every request sent is counted once."""
    server = make_server(
        api_key="s3cret", max_queue_size=1, fault_hang_stage="sam_encoder", fault_hang_s=0.5,
        enable_swin=False, max_batch_size=1, batch_buckets=[1],
    )  # fmt: skip
    base = StepSpec(
        url=server.url, rates=(("segment", 10.0),), seconds=1.5, warmup_s=0.0, timeout_s=10.0,
        processes=1, seed=7, nonce="refusals", images=load_images(small_jpeg_dir),
    )  # fmt: skip

    def row(**changes: Any) -> dict[str, Any]:
        samples = run_step(replace(base, **changes), None, lead_in_s=0.1)
        out = report.summarize(samples, "segment@10", "segment", 10.0, 0.0, 1.5)
        assert out["sent"] == len(samples) > 3, out
        assert out["ok"] + sum(out["errors"].values()) == out["sent"], out
        return out

    no_key = row()
    assert no_key["errors"] == {"401": no_key["sent"]}, no_key
    refused = row(api_key="s3cret")
    assert refused["ok"] >= 1 and refused["errors"].get("429", 0) >= 1, refused
    assert set(refused["errors"]) <= {"429", "503"}, refused
    impatient = row(api_key="s3cret", timeout_s=0.2, seed=8)
    assert impatient["errors"].get("timeout", 0) >= 1, impatient
    closed = row(url=f"http://127.0.0.1:{free_port()}")
    assert closed["errors"] == {"conn_error": closed["sent"]}, closed
