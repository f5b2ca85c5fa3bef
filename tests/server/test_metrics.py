"""`/metrics` against a real server: every family the service exports is there with its type
and labels, and each moves exactly as the requests made say it must.

Each test scrapes before and after real HTTP requests to a LiveServer (tiny models on the
CPU) and compares. Faults that a CPU cannot produce on demand (a stuck worker, running out
of device memory, a failing batch) are injected with the service's fault settings
(server/engine/faults.py), so the code that counts them is the real one. GPU memory families exist
only where CUDA does: on a CPU machine the test asserts they are absent.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from server.engine.gpu_memory import sample_gpu_memory
from server.metrics import Metrics
from tests.server.conftest import LiveServer, encode, photo_like, small_settings

BOX = [10, 10, 100, 90]
STAGES = ("sam_encoder", "sam_decoder", "swin")
REASONS = {"unauthorized", "queue_full", "cancelled", "not_ready", "deadline",
           "out_of_memory", "bad_input", "internal"}  # fmt: skip

# The contract docs/OBSERVABILITY.md documents: family (as parsed, counters without
# `_total`) -> (type, label names).
FAMILIES: dict[str, tuple[str, set[str]]] = {
    "serve_request_duration_seconds": ("histogram", {"route", "method", "status"}),
    "serve_requests": ("counter", {"route", "method", "status"}),
    "serve_rejections": ("counter", {"reason"}),
    "serve_pixels_inline": ("counter", set()),
    "serve_in_flight_requests": ("gauge", set()),
    "serve_pinned_image_bytes": ("gauge", set()),
    "serve_queue_wait_seconds": ("histogram", {"stage"}),
    "serve_batch_duration_seconds": ("histogram", {"stage"}),
    "serve_batch_gpu_seconds": ("histogram", {"stage"}),  # observed on CUDA only
    "serve_batch_size": ("histogram", {"stage"}),
    "serve_batch_failures": ("counter", {"stage"}),
    "serve_batch_drops": ("counter", {"stage", "reason"}),
    "serve_oom_events": ("counter", {"stage"}),
    "serve_worker_stuck": ("gauge", {"stage"}),
    "serve_queue_depth": ("gauge", {"stage"}),
    "serve_phase_duration_seconds": ("histogram", {"phase"}),
    "serve_warmup_seconds": ("gauge", set()),
    "serve_compile_cache_events": ("gauge", {"event"}),
    "serve_fidelity": ("gauge", {"model", "measure"}),
    "serve_ready": ("gauge", set()),
    "serve_model_info": ("gauge", {"name", "weights", "precision", "device", "compile_mode"}),
    "serve_embedding_cache_events": ("counter", {"event"}),
    "serve_embedding_cache_bytes": ("gauge", {"tier"}),
    "serve_embedding_cache_entries": ("gauge", {"tier"}),
}


# The families every Prometheus client library's default registry exports (Linux).
STANDARD_PREFIXES = ("process_", "python_")
STANDARD: dict[str, str] = {
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_cpu_seconds": "counter",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "python_info": "gauge",
    "python_gc_objects_collected": "counter",
    "python_gc_objects_uncollectable": "counter",
    "python_gc_collections": "counter",
}


class Scrape:
    """One parsed `/metrics` answer; `seq` numbers the scrapes of one `Scraper`."""

    def __init__(self, text: str, seq: int) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.seq = seq

    def samples(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for f in self.families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
        return sum(s.value for s in self.samples(name, **labels))


class Scraper:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=32))
        self.seq = 0

    def __call__(self) -> Scrape:
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        self.seq += 1
        return Scrape(r.text, self.seq)

    def until(self, done: Callable[[Scrape], bool], timeout_s: float = 10.0) -> Scrape:
        """Scrape until `done` holds: a request is counted just after its response is sent."""
        deadline = time.monotonic() + timeout_s
        while True:
            scrape = self()
            if done(scrape) or time.monotonic() > deadline:
                return scrape
            time.sleep(0.02)


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def b64_png(seed: int) -> str:
    return base64.b64encode(encode(photo_like(160, 120, seed=seed), "PNG")).decode()


def burst(fn: Callable[[int], httpx.Response], args: list[int]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # 100 ms of queue delay: requests sent together reliably share a batch.
    live = LiveServer(small_settings(max_queue_delay_ms=100.0)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def scrape(server: LiveServer) -> Iterator[Scraper]:
    scraper = Scraper(server.url)
    yield scraper
    scraper.http.close()


# -- what is exported ----------------------------------------------------------------


def test_every_family_is_exported_with_its_type_and_labels(scrape):
    http = scrape.http
    assert http.post("/v1/segment", json={"image": b64_png(1), "box": BOX}).status_code == 200
    assert http.post("/v1/classify", json={"image": b64_png(2)}).status_code == 200
    after = scrape()
    exported = {
        name: f.type
        for name, f in after.families.items()
        if not name.startswith(("serve_gpu_", *STANDARD_PREFIXES))
    }  # GPU memory: CUDA only, see below; the standard families: their own test
    assert exported == {name: kind for name, (kind, _) in FAMILIES.items()}
    # the same set server.metrics declares (with the GPU sampler's where there is CUDA)
    declared = Metrics()
    sample_gpu_memory(declared)
    assert set(after.families) == {f.name for f in declared.registry.collect()}
    for name, (_, labels) in FAMILIES.items():
        for sample in after.families[name].samples:
            assert set(sample.labels) - {"le"} == labels, sample


def test_standard_process_families_and_no_created_series(scrape):
    after = scrape()
    assert {n: f.type for n, f in after.families.items() if n.startswith(STANDARD_PREFIXES)} == (
        STANDARD
    )
    # this process: a resident set of more than the 20 MB of the interpreter, CPU spent on
    # loading and warming the models, and open fds (the listening socket at least)
    assert after.value("process_resident_memory_bytes") > 20e6
    assert after.value("process_cpu_seconds_total") > 0
    assert 0 < after.value("process_open_fds") < after.value("process_max_fds")
    assert after.value("process_start_time_seconds") < time.time()
    # counters and histograms without their `_created` twins
    names = [s.name for f in after.families.values() for s in f.samples]
    assert any(n.endswith("_total") for n in names)
    assert not [n for n in names if n.endswith("_created")]


def test_models_ready_and_warm_up(scrape):
    after = scrape()
    models = scrape.http.get("/v1/models").json()["models"]
    info = [s.labels for s in after.samples("serve_model_info")]
    assert sorted(info, key=lambda labels: labels["name"]) == [
        {"name": "sam_vit_tiny", "weights": "random", "precision": "fp32", "device": "cpu",
         "compile_mode": "none"},
        {"name": "swin_test", "weights": "random", "precision": "fp32", "device": "cpu",
         "compile_mode": "none"},
    ]  # fmt: skip
    keys = ("name", "weights", "precision", "device", "compile_mode")
    assert sorted(info, key=lambda labels: labels["name"]) == sorted(
        ({k: m[k] for k in keys} for m in models), key=lambda labels: labels["name"]
    )
    assert all(s.value == 1 for s in after.samples("serve_model_info"))
    assert after.value("serve_ready") == 1
    assert after.value("serve_warmup_seconds") > 0
    # nothing is compiled on the CPU, but both events are reported
    assert {s.labels["event"] for s in after.samples("serve_compile_cache_events")} == {
        "hit",
        "miss",
    }
    assert after.value("serve_compile_cache_events") == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine exports GPU memory")
def test_no_gpu_memory_families_on_a_cpu_machine(scrape):
    # serve_gpu_memory_{allocated,reserved,peak_allocated}_bytes and (with nvidia-ml-py)
    # serve_gpu_device_{used,total}_bytes come from the engine's sampler, which sets them only
    # on CUDA.
    assert not [name for name in scrape().families if name.startswith("serve_gpu_")]


# -- requests ---------------------------------------------------------------------------


def test_requests_are_counted_by_route_method_and_status(scrape):
    http = scrape.http
    made: collections.Counter[tuple[str, str, str]] = collections.Counter()
    client_s: collections.defaultdict[tuple[str, str, str], float] = collections.defaultdict(float)

    def call(method: str, path: str, route: str | None = None, **kw: object) -> httpx.Response:
        started = time.perf_counter()
        r = http.request(method, path, **kw)  # type: ignore[arg-type]
        labels = (route or path, method, str(r.status_code))
        made[labels] += 1
        client_s[labels] += time.perf_counter() - started
        return r

    before = scrape()
    assert call("POST", "/v1/segment", json={"image": b64_png(11), "box": BOX}).is_success
    r = call("POST", "/v1/segment", files={"image": ("a.png", base64.b64decode(b64_png(12)))},
             data={"request": '{"point_coords": [[50, 40]], "point_labels": [1]}'})  # fmt: skip
    assert r.status_code == 200, r.text
    image_id = call("POST", "/v1/embed", json={"image": b64_png(13)}).json()["image_id"]
    r = call("GET", f"/v1/embeddings/{image_id}", route="/v1/embeddings/{image_id}")
    assert r.status_code == 200
    assert call("POST", "/v1/classify", json={"image": b64_png(14)}).status_code == 200
    bad_box = {"image": b64_png(15), "box": [1, 2, 3]}
    assert call("POST", "/v1/segment", json=bad_box).status_code == 422
    unknown = {"image_id": "0" * 64, "box": BOX}
    assert call("POST", "/v1/segment", json=unknown).status_code == 404
    assert call("GET", "/v1/models").status_code == 200
    assert call("GET", "/no/such/path", route="unmatched").status_code == 404

    def expected(scrape_seq: int) -> collections.Counter[tuple[str, str, str]]:
        # every scrape before the last one counts too (itself only once it has answered)
        return made + collections.Counter({("/metrics", "GET", "200"): scrape_seq - before.seq})

    def counted(s: Scrape, labels: tuple[str, str, str]) -> float:
        route, method, status = labels
        return delta(before, s, "serve_requests_total", route=route, method=method, status=status)

    after = scrape.until(lambda s: all(counted(s, k) >= n for k, n in expected(s.seq).items()))
    want = expected(after.seq)
    seen = {
        (s.labels["route"], s.labels["method"], s.labels["status"])
        for s in after.samples("serve_requests_total")
    }
    for labels in seen | set(want):
        route, method, status = labels
        match = {"route": route, "method": method, "status": status}
        n = want.get(labels, 0)
        assert counted(after, labels) == n, labels
        assert delta(before, after, "serve_request_duration_seconds_count", **match) == n, labels
        inf = delta(before, after, "serve_request_duration_seconds_bucket", le="+Inf", **match)
        assert inf == n, labels
        if labels in client_s:  # the server's time is within what the client waited
            seconds = delta(before, after, "serve_request_duration_seconds_sum", **match)
            assert 0 < seconds <= client_s[labels], labels
    buckets = [
        s.value
        for s in after.samples("serve_request_duration_seconds_bucket", route="/v1/segment",
                               method="POST", status="200")
    ]  # fmt: skip
    assert buckets == sorted(buckets), "cumulative buckets"
    # the 422 and the unknown image_id are bad input; an unknown path is no rejection
    moved = {r: delta(before, after, "serve_rejections_total", reason=r) for r in REASONS}
    assert moved == {r: 2 if r == "bad_input" else 0 for r in REASONS}


def test_concurrent_requests_share_batches(scrape):
    before = scrape()
    n = 16
    responses = burst(
        lambda seed: scrape.http.post("/v1/segment", json={"image": b64_png(seed), "box": BOX}),
        list(range(100, 100 + n)),
    )
    assert [r.status_code for r in responses] == [200] * n
    after = scrape.until(lambda s: delta(before, s, "serve_phase_duration_seconds_count",
                                         phase="mask_encode") >= n)  # fmt: skip
    for stage in ("sam_encoder", "sam_decoder"):
        batches = delta(before, after, "serve_batch_size_count", stage=stage)
        items = delta(before, after, "serve_batch_size_sum", stage=stage)
        assert items == n, stage  # distinct images: each encoded once; one prompt set each
        assert 1 <= batches < n, f"{stage}: {batches} batches for {n} items"
        singles = delta(before, after, "serve_batch_size_bucket", stage=stage, le="1.0")
        assert singles < batches, f"{stage}: some batch holds more than one item"
        assert delta(before, after, "serve_queue_wait_seconds_count", stage=stage) == n
        assert delta(before, after, "serve_queue_wait_seconds_sum", stage=stage) >= 0
        assert delta(before, after, "serve_batch_duration_seconds_count", stage=stage) == batches
        assert delta(before, after, "serve_batch_duration_seconds_sum", stage=stage) > 0
    # an encoder batch never holds more than max_batch_size (4) images
    encoder_batches = delta(before, after, "serve_batch_size_count", stage="sam_encoder")
    assert delta(before, after, "serve_batch_size_bucket", stage="sam_encoder", le="4.0") == (
        encoder_batches
    )
    for phase in ("image_decode", "encode", "decode", "mask_encode"):
        assert delta(before, after, "serve_phase_duration_seconds_count", phase=phase) == n, phase
        assert delta(before, after, "serve_phase_duration_seconds_sum", phase=phase) > 0, phase
    assert delta(before, after, "serve_batch_failures_total") == 0
    assert delta(before, after, "serve_batch_drops_total") == 0
    for stage in STAGES:
        assert after.value("serve_queue_depth", stage=stage) == 0, stage
    # the scrape itself is in flight while it renders; nothing else is
    assert after.value("serve_in_flight_requests") == before.value("serve_in_flight_requests")


def test_embedding_cache_hits_misses_and_bytes(scrape):
    http = scrape.http
    before = scrape()
    image = b64_png(200)
    first = http.post("/v1/embed", json={"image": image}).json()
    assert first["cached"] is False
    mid = scrape()
    assert delta(before, mid, "serve_embedding_cache_events_total", event="miss") == 1
    assert delta(before, mid, "serve_embedding_cache_entries", tier="device") == 1
    grown = delta(before, mid, "serve_embedding_cache_bytes", tier="device")
    # vit_tiny: one [256, 16, 16] float32 embedding
    assert grown == 256 * 16 * 16 * 4
    r = http.post("/v1/segment", json={"image_id": first["image_id"], "box": BOX})
    assert r.status_code == 200, r.text
    assert http.post("/v1/embed", json={"image": image}).json()["cached"] is True
    after = scrape()
    assert delta(mid, after, "serve_embedding_cache_events_total", event="hit") == 2
    assert delta(mid, after, "serve_embedding_cache_events_total", event="miss") == 0
    assert delta(mid, after, "serve_batch_size_count", stage="sam_encoder") == 0, "no encoding"
    assert delta(mid, after, "serve_embedding_cache_bytes", tier="device") == 0
    assert after.value("serve_embedding_cache_bytes", tier="host") == 0  # no host tier set


def test_classify_and_everything_phases(scrape):
    http = scrape.http
    before = scrape()
    n = 3
    responses = burst(
        lambda seed: http.post("/v1/classify", json={"image": b64_png(seed), "top_k": 2}),
        list(range(300, 300 + n)),
    )
    assert [r.status_code for r in responses] == [200] * n
    r = http.post("/v1/segment/everything", json={"image": b64_png(310), "points_per_side": 4})
    assert r.status_code == 200, r.text
    after = scrape()
    assert delta(before, after, "serve_batch_size_sum", stage="swin") == n
    assert delta(before, after, "serve_queue_wait_seconds_count", stage="swin") == n
    batches = delta(before, after, "serve_batch_size_count", stage="swin")
    assert delta(before, after, "serve_batch_duration_seconds_count", stage="swin") == batches
    phases = {"classify": n, "image_decode": n + 1, "generate": 1, "encode": 1, "mask_encode": 1}
    for phase, count in phases.items():
        assert delta(before, after, "serve_phase_duration_seconds_count", phase=phase) == count


# -- refusals and faults ----------------------------------------------------------------


def test_every_rejection_reason_moves(make_server):
    """One server provokes all eight reasons: an API key (401), a queue of one whose encoder
    batches hang 0.6 s (429, 504, 499, and a watchdog at 0.25 s), Swin out of memory on
    every batch (507), a decoder that raises (500), then a drain (503)."""
    server = make_server(
        api_key="s3cret", max_queue_size=1, fault_hang_stage="sam_encoder", fault_hang_s=0.6,
        fault_oom_stage="swin", fault_oom_min_batch=1, fault_raise_stage="sam_decoder",
        watchdog_timeout_s=0.25,
    )  # fmt: skip
    scrape = Scraper(server.url)  # /metrics needs no key (SERVE_METRICS_REQUIRE_KEY=false)
    key = {"X-API-Key": "s3cret"}
    http = httpx.Client(base_url=server.url, timeout=60, headers=key)
    try:
        before = scrape()
        r = httpx.post(server.url + "/v1/segment", json={"image": b64_png(1), "box": BOX})
        assert r.status_code == 401
        assert http.post("/v1/segment", json={"image": b64_png(1), "box": [1]}).status_code == 422

        # a burst against a queue of one: one batch runs, one waits, the rest get 429
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [
                pool.submit(http.post, "/v1/embed", json={"image": b64_png(seed)})
                for seed in range(10, 16)
            ]
            during = scrape.until(
                lambda s: s.value("serve_worker_stuck", stage="sam_encoder") == 1, timeout_s=5
            )
            responses = [f.result() for f in futures]
        assert during.value("serve_worker_stuck", stage="sam_encoder") == 1
        idle = before.value("serve_in_flight_requests")
        assert during.value("serve_in_flight_requests") >= idle + 1, "a hung embed is in flight"
        assert during.value("serve_queue_depth", stage="sam_encoder") <= 1
        statuses = collections.Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 429} and sum(statuses.values()) == 6, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"

        headers = {"X-Request-Timeout-Ms": "100"}
        r = http.post("/v1/embed", json={"image": b64_png(20)}, headers=headers)
        assert r.status_code == 504, r.text
        with pytest.raises(httpx.ReadTimeout):  # the client gives up: the server sees 499
            httpx.post(server.url + "/v1/embed", json={"image": b64_png(21)}, headers=key,
                       timeout=0.2)  # fmt: skip
        r = http.post("/v1/classify", json={"image": b64_png(22)})
        assert r.status_code == 507 and r.json()["error"]["code"] == "out_of_memory", r.text
        r = http.post("/v1/segment", json={"image": b64_png(23), "box": BOX})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
        server.app.state.serve.begin_drain()
        assert http.post("/v1/classify", json={"image": b64_png(24)}).status_code == 503

        expected = {
            "unauthorized": 1, "bad_input": 1, "queue_full": statuses[429], "deadline": 1,
            "cancelled": 1, "out_of_memory": 1, "internal": 1, "not_ready": 1,
        }  # fmt: skip
        assert set(expected) == REASONS
        after = scrape.until(
            lambda s: (
                delta(before, s, "serve_rejections_total", reason="cancelled") >= 1
                and s.value("serve_worker_stuck", stage="sam_encoder") == 0
            )
        )
        moved = {r: delta(before, after, "serve_rejections_total", reason=r) for r in REASONS}
        assert moved == expected
        drops = {
            (s.labels["stage"], s.labels["reason"]): s.value
            for s in after.samples("serve_batch_drops_total")
            if s.value
        }
        # a burst's 429 comes from the encoder's full queue, or, where the engine's loop read
        # the call over INTAKE_LAG_S after it was sent (CI's two busy cores did, 2026-11-28),
        # from its door ("intake"): each counted once, in one place or the other
        refused = sum(drops.pop((stage, "queue_full"), 0) for stage in ("sam_encoder", "intake"))
        assert refused == statuses[429]
        assert drops == {("sam_encoder", "deadline"): 1, ("sam_encoder", "cancelled"): 1}
        assert delta(before, after, "serve_oom_events_total", stage="swin") == 1
        assert delta(before, after, "serve_batch_failures_total", stage="sam_decoder") == 1
        assert delta(before, after, "serve_batch_failures_total", stage="swin") == 0  # split
        unauthorized = after.value("serve_requests_total", route="/v1/segment", status="401")
        assert unauthorized == 1, "refused by middleware, still labelled with its route"
        for stage in STAGES:
            assert after.value("serve_queue_depth", stage=stage) == 0, stage
            assert after.value("serve_worker_stuck", stage=stage) == 0, stage
        assert after.value("serve_in_flight_requests") == before.value("serve_in_flight_requests")
        assert (before.value("serve_ready"), after.value("serve_ready")) == (1, 0)  # drained
    finally:
        http.close()
        scrape.http.close()


# -- a fresh server: series, in-flight and probes before any work -------------------------


@pytest.fixture(scope="module")
def fresh() -> Iterator[tuple[LiveServer, Scraper]]:
    """A server that has answered nothing but its readiness polls."""
    live = LiveServer(small_settings()).start()
    scraper = Scraper(live.url)
    yield live, scraper
    scraper.http.close()
    live.stop()


def test_known_series_exist_before_the_first_request(fresh):
    _, scrape = fresh
    first = scrape()
    assert {s.labels["reason"] for s in first.samples("serve_rejections_total")} == REASONS
    for name in ("serve_queue_depth", "serve_worker_stuck", "serve_batch_failures_total",
                 "serve_oom_events_total"):  # fmt: skip
        assert {s.labels["stage"] for s in first.samples(name)} == set(STAGES), name


def test_in_flight_is_zero_when_idle(fresh):
    _, scrape = fresh
    assert scrape().value("serve_in_flight_requests") == 0


def test_no_pinned_image_memory_without_cuda(fresh):
    """The gauge reads the engine's image memory at scrape time: ordinary memory here."""
    _, scrape = fresh
    assert scrape().value("serve_pinned_image_bytes") == 0


def test_probe_answers_are_not_rejections(fresh):
    live, scrape = fresh
    before = scrape()
    live.app.state.serve.begin_drain()  # last test on this server: it drains
    assert scrape.http.get("/readyz").status_code == 503
    after = scrape.until(
        lambda s: delta(before, s, "serve_requests_total", route="/readyz", status="503") >= 1
    )
    assert delta(before, after, "serve_requests_total", route="/readyz", status="503") == 1
    assert delta(before, after, "serve_rejections_total", reason="not_ready") == 0
