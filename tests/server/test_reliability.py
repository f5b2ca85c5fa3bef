"""Failure handling, each provoked for real: SIGTERM in the middle of a burst, a batch out
of device memory, an exception in one stage, a hung stage. Faults are injected with the
service's fault settings (server/engine/faults.py): the code that handles them is the real one."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import encode, free_port, photo_like, spawn_server, wait_until_ready
from tests.server.test_api_errors import assert_error

ROOT = Path(__file__).resolve().parents[2]


def b64_image(seed: int, size: tuple[int, int] = (160, 120)) -> str:
    return base64.b64encode(encode(photo_like(*size, seed=seed), "PNG")).decode()


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def metric_batches(url: str, stage: str) -> float:
    with httpx.Client(base_url=url) as c:
        return metric(c, "serve_batch_size_count", stage=stage)


def segment(url: str, seed: int, timeout: float = 120) -> httpx.Response:
    body = {"image": b64_image(seed), "box": [10, 10, 100, 90]}
    return httpx.post(url + "/v1/segment", json=body, timeout=timeout)


def test_sigterm_drains_accepted_requests_then_exits_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_ENABLE_SWIN": "false", "SERVE_MAX_BATCH_SIZE": "2",
           "SERVE_BATCH_BUCKETS": "[1,2]", "SERVE_DECODER_MAX_BATCH_PROMPTS": "4",
           # every encoder batch takes 0.4 s: the burst is still in flight at SIGTERM
           "SERVE_FAULT_HANG_STAGE": "sam_encoder", "SERVE_FAULT_HANG_S": "0.4",
           "SERVE_DRAIN_TIMEOUT_S": "60", "SERVE_LOG_LEVEL": "INFO",
           "SERVE_HTTP_WORKERS": "2"}  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = spawn_server(env, port, log)
    try:
        wait_until_ready(proc, url, tmp_path / "server.log", 240)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(segment, url, seed) for seed in range(8)]
            with httpx.Client(base_url=url, timeout=10) as c:
                # SIGTERM only once all eight are accepted: being served, or already answered.
                # Finished ones are counted first, so one that ends between the two reads is
                # counted in neither (wait longer) rather than in both (signal too early).
                while sum(f.done() for f in burst) + metric(c, "serve_in_flight_requests") < 8:
                    time.sleep(0.02)
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                assert_error(c.get("/readyz"), 503, "not_ready")
                late = c.post("/v1/segment", json={"image": b64_image(99), "box": [0, 0, 9, 9]})
                assert_error(late, 503, "not_ready")
                assert c.get("/healthz").json()["draining"] is True
            answers = [f.result(timeout=120) for f in burst]
        for r in answers:  # every accepted request got its whole, correct answer
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["masks"][0]["segmentation"]["size"] == [120, 160]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert "drained" in (tmp_path / "server.log").read_text()


def test_out_of_memory_batches_split_and_succeed(make_server):
    # encoder batches of 2 or more run out of memory; singles fit. Each batch lasts 0.5 s, so
    # what arrives while the first (alone, on an idle worker) runs is batched behind it.
    server = make_server(enable_swin=False, fault_oom_min_batch=2, fault_oom_stage="sam_encoder",
                         fault_hang_stage="sam_encoder", fault_hang_s=0.5,
                         max_queue_delay_ms=300)  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: segment(server.url, seed), range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    with httpx.Client(base_url=server.url) as c:
        ooms = metric(c, "serve_oom_events_total", stage="sam_encoder")
        batched = metric(c, "serve_batch_size_sum", stage="sam_encoder")
    # every batch of n > 1 ran out of memory once and became two halves: n - 1 events each
    assert ooms >= 1
    assert ooms == batched - metric_batches(server.url, "sam_encoder")


def test_a_request_that_never_fits_fails_alone(make_server, png_bytes):
    server = make_server(fault_oom_min_batch=1, fault_oom_stage="sam_decoder")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/segment", json={"image": b64_image(1), "box": [0, 0, 50, 50]})
        assert_error(r, 507, "out_of_memory")
        # the service goes on: healthy, and the other model answers
        assert c.get("/healthz").status_code == 200
        ok = c.post("/v1/classify", files={"image": ("a.png", png_bytes, "image/png")})
        assert ok.status_code == 200, ok.text
        assert metric(c, "serve_rejections_total", reason="out_of_memory") == 1


def test_an_exception_fails_only_its_stage(make_server, png_bytes):
    server = make_server(fault_raise_stage="swin")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        bad = c.post("/v1/classify", files={"image": ("a.png", png_bytes, "image/png")})
        assert_error(bad, 500, "internal")
        assert "swin" in bad.json()["error"]["message"]
        good = c.post("/v1/segment", json={"image": b64_image(2), "box": [0, 0, 50, 50]})
        assert good.status_code == 200, good.text
        assert c.get("/healthz").status_code == 200


def test_watchdog_reports_a_hung_worker(make_server):
    server = make_server(enable_swin=False, fault_hang_stage="sam_decoder", fault_hang_s=4.0,
                         watchdog_timeout_s=1.0)  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as c:
        image = b64_image(3)
        started = time.monotonic()
        r = c.post("/v1/segment", json={"image": image, "box": [0, 0, 50, 50]},
                   headers={"X-Request-Timeout-Ms": "1500"})  # fmt: skip
        assert_error(r, 504, "deadline_exceeded")
        assert time.monotonic() - started < 3.5  # the caller is not held by the hang
        for _ in range(40):  # the watchdog ticks every 0.25 s
            health = c.get("/healthz")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert_error(health, 503, "worker_stuck")
        assert metric(c, "serve_worker_stuck", stage="sam_decoder") == 1
        for _ in range(200):  # when the batch returns, the worker is healthy again
            if c.get("/healthz").status_code == 200:
                break
            time.sleep(0.05)
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize("stage", ["sam_encoder", "sam_decoder", "swin"])
def test_fault_settings_name_real_stages(stage):
    """A typo in a fault setting would silently inject nothing: the stages are these."""
    from server.settings import Settings

    assert Settings(fault_raise_stage=stage).fault_raise_stage == stage
