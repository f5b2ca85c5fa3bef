"""`/metrics` across processes (PROMETHEUS_MULTIPROC_DIR): real separate processes, each a
`Metrics(role)` like the supervisor's engine and frontends, record what their requests and
batches would; a render from any of them, or from a process of none of them, shows the
whole service.

Each role runs `CHILD` with `sys.executable -c`: it records its scenario, reports its pid,
then answers commands on stdin (render, act, exit) until told to exit, so that it is alive
(for `process_*`) while the test renders. The test process itself, single-process mode,
renders the folder as a fresh scraper would (`render_folder`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics_multiprocess import forget_process, live_processes, render_folder

REPO = Path(__file__).resolve().parents[2]
STAGES = ("sam_encoder", "sam_decoder", "swin")
PROCESS_FAMILIES = {
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_cpu_seconds": "counter",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_start_time_seconds": "gauge",
}

CHILD = r"""
import json, os, sys
from server.metrics import Metrics

role = sys.argv[1]
m = Metrics(role)

def frontend(seconds, in_flight):
    m.request_seconds.labels("/v1/segment", "POST", "200").observe(seconds)
    m.requests.labels("/v1/segment", "POST", "200").inc()
    m.rejections.labels("bad_input").inc()
    m.phase_seconds.labels("image_decode").observe(0.01)
    m.in_flight.inc(in_flight)

def engine(warmup, ready):
    from server.domain import ModelInfo  # the engine imports torch; a frontend never
    for stage in ("sam_encoder", "sam_decoder", "swin"):
        m.declare(stage)
    m.batch_started("sam_encoder", 4, 4, [0.01, 0.02, 0.03, 0.04])
    m.batch_finished("sam_encoder", 4, 0.2, False)
    m.batch_started("swin", 1, 1, [0.5])
    m.batch_finished("swin", 1, 0.1, True)
    m.rejected("sam_encoder", "queue_full")
    m.out_of_memory("swin", 1)
    m.queue_depth("sam_encoder", 3)
    for event in ("hit", "hit", "miss"):
        m.cache_event(event)
    m.cache_size("device", 2, 1000)
    m.set_models([ModelInfo(name="sam_vit_tiny", weights="random", precision="fp32",
                            device="cuda:" + role[-1], compile_mode="none", attention="sdpa",
                            cuda_graphs=False, batch_buckets=(1, 2))])
    m.warmup_seconds.set(warmup)
    m.compile_cache.labels("hit").set(3)
    m.fidelity.labels("sam", "mask_iou_mean").set(warmup / 10)
    m.track_engine(lambda: 4096)  # a pretend pinned buffer; no GPU here: no serve_gpu_*
    m.ready.set(ready)

SCENARIOS = {
    "frontend-0": lambda: frontend(0.05, 1),
    "frontend-1": lambda: frontend(0.5, 2),
    "engine-0": lambda: engine(2.5, 1),
    "engine-1": lambda: engine(4.0, 0),
}
SCENARIOS[role]()
print(json.dumps({"pid": os.getpid(), "torch": "torch" in sys.modules}), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "render":
        print(json.dumps({"text": m.render().decode()}), flush=True)
    elif command == "drain":
        m.ready.set(0)
        print("{}", flush=True)
    elif command == "warm":
        m.ready.set(1)
        print("{}", flush=True)
    elif command == "stuck":
        m.worker_stuck.labels("swin").set(1)
        print("{}", flush=True)
    elif command == "nvml":  # what every engine's sampler reads from the driver, alike
        m.set_gpu_device_memory("0", used=100.0, total=1000.0)
        print("{}", flush=True)
    else:
        break
"""


class Role:
    """One process of the pretend service."""

    def __init__(self, folder: Path, role: str) -> None:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder), "PYTHONPATH": str(REPO)}
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=REPO,
        )  # fmt: skip
        hello = self._answer()
        self.pid: int = hello["pid"]
        self.imported_torch: bool = hello["torch"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"{self.role} exited with {self.proc.wait(10)}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def render(self) -> Scrape:
        return Scrape(self.send("render")["text"])

    def exit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (s.labels, s.value)
            for f in self.families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        return sum(value for _, value in self.samples(name, **labels))

    def service(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The serve_* samples: what every renderer must agree on."""
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in self.families.values()
            if f.name.startswith("serve_")
            for s in f.samples
        }


def render(folder: Path) -> Scrape:
    return Scrape(render_folder(folder).decode())


@pytest.fixture
def service(tmp_path: Path) -> Iterator[dict[str, Role]]:
    """An engine and two frontends, alive, each having recorded its scenario."""
    roles = {name: Role(tmp_path, name) for name in ("engine-0", "frontend-0", "frontend-1")}
    yield roles
    for role in roles.values():
        role.exit()


def test_counters_sum_and_histograms_merge_across_frontends(service, tmp_path):
    scrape = render(tmp_path)
    route = {"route": "/v1/segment", "method": "POST", "status": "200"}
    assert scrape.value("serve_requests_total", **route) == 2
    assert scrape.value("serve_request_duration_seconds_count", **route) == 2
    assert scrape.value("serve_request_duration_seconds_sum", **route) == pytest.approx(0.55)
    bucket = "serve_request_duration_seconds_bucket"
    assert scrape.value(bucket, le="0.05", **route) == 1  # frontend-0's 50 ms
    assert scrape.value(bucket, le="0.25", **route) == 1
    assert scrape.value(bucket, le="0.5", **route) == 2  # and frontend-1's 500 ms
    assert scrape.value(bucket, le="+Inf", **route) == 2
    assert scrape.value("serve_rejections_total", reason="bad_input") == 2
    assert scrape.value("serve_rejections_total", reason="internal") == 0
    assert scrape.value("serve_phase_duration_seconds_count", phase="image_decode") == 2
    assert scrape.value("serve_in_flight_requests") == 3  # livesum: 1 + 2
    assert not [line for line in scrape.text.splitlines() if "_created" in line]


def test_engine_stage_metrics_show_in_every_render(service, tmp_path):
    fresh = render(tmp_path)
    for scrape in (fresh, service["frontend-0"].render(), service["frontend-1"].render()):
        assert scrape.value("serve_batch_size_count", stage="sam_encoder") == 1
        assert scrape.value("serve_batch_size_sum", stage="sam_encoder") == 4
        assert scrape.value("serve_queue_wait_seconds_count", stage="sam_encoder") == 4
        assert scrape.value("serve_queue_wait_seconds_sum", stage="sam_encoder") == (
            pytest.approx(0.1)
        )
        assert scrape.value("serve_batch_duration_seconds_sum", stage="sam_encoder") == 0.2
        assert scrape.value("serve_batch_failures_total", stage="swin") == 1
        assert scrape.value("serve_batch_failures_total", stage="sam_encoder") == 0
        assert (
            scrape.value("serve_batch_drops_total", stage="sam_encoder", reason="queue_full") == 1
        )
        assert scrape.value("serve_oom_events_total", stage="swin") == 1
        depths = {labels["stage"]: value for labels, value in scrape.samples("serve_queue_depth")}
        assert depths == {"sam_encoder": 3, "sam_decoder": 0, "swin": 0}
        assert {labels["stage"] for labels, _ in scrape.samples("serve_worker_stuck")} == set(
            STAGES
        )
        assert scrape.value("serve_embedding_cache_events_total", event="hit") == 2
        assert scrape.value("serve_embedding_cache_events_total", event="miss") == 1
        assert scrape.value("serve_embedding_cache_bytes", tier="device") == 1000
        assert scrape.value("serve_embedding_cache_entries", tier="device") == 2
        [(info, one)] = scrape.samples("serve_model_info")
        assert (info["name"], info["device"], one) == ("sam_vit_tiny", "cuda:0", 1)
        assert scrape.value("serve_ready") == 1
        assert scrape.value("serve_warmup_seconds") == 2.5
        assert scrape.value("serve_compile_cache_events", event="hit") == 3
        assert scrape.value("serve_pinned_image_bytes") == 4096  # the engine's sampler
        assert not [name for name in scrape.families if name.startswith("serve_gpu_")]
    # the serve_* families read the same from any process (process_* move on their own)
    assert service["frontend-0"].render().service() == fresh.service()


def test_frontends_never_import_torch(service):
    assert not service["frontend-0"].imported_torch
    assert not service["frontend-1"].imported_torch
    assert service["engine-0"].imported_torch  # the check can see torch when it is there


def test_process_families_once_per_live_process(service, tmp_path):
    scrape = render(tmp_path)
    roles = {"engine-0", "frontend-0", "frontend-1"}
    for name, kind in PROCESS_FAMILIES.items():
        assert scrape.families[name].type == kind, name
        labels = [s.labels for s in scrape.families[name].samples]
        assert sorted(labels, key=lambda label: label["process"]) == [
            {"process": role} for role in sorted(roles)
        ], name
    for role in roles:
        started = scrape.value("process_start_time_seconds", process=role)
        assert time.time() - 600 < started < time.time() + 1, role
        assert scrape.value("process_resident_memory_bytes", process=role) > 5e6, role
        assert (
            0
            < scrape.value("process_open_fds", process=role)
            < scrape.value("process_max_fds", process=role)
        )
        assert scrape.value("process_cpu_seconds_total", process=role) > 0, role
    # the engine loaded torch: it is the largest process here
    rss = {role: scrape.value("process_resident_memory_bytes", process=role) for role in roles}
    assert max(rss, key=rss.__getitem__) == "engine-0"
    info = {labels["process"]: labels for labels, _ in scrape.samples("python_info")}
    assert set(info) == roles
    assert info["frontend-0"]["version"] == ".".join(map(str, sys.version_info[:3]))
    for family in ("python_gc_collections", "python_gc_objects_collected"):
        seen = {labels["process"] for labels, _ in scrape.samples(family + "_total")}
        assert seen == roles, family
    assert {entry.pid for entry in live_processes(tmp_path)} == {
        role.pid for role in service.values()
    }


def test_a_forgotten_process_leaves_its_counters_not_its_gauges(service, tmp_path):
    gone = service["frontend-1"]
    gone.exit()
    # dead but not yet forgotten: no process_* for it (its pid is gone), its gauges remain
    scrape = render(tmp_path)
    assert "frontend-1" not in {labels["process"] for labels, _ in
                                scrape.samples("process_resident_memory_bytes")}  # fmt: skip
    assert scrape.value("serve_in_flight_requests") == 3
    forget_process(tmp_path, gone.pid)
    scrape = render(tmp_path)
    assert scrape.value("serve_in_flight_requests") == 1  # frontend-0's only
    route = {"route": "/v1/segment", "method": "POST", "status": "200"}
    assert scrape.value("serve_requests_total", **route) == 2  # counters stay
    assert scrape.value("serve_request_duration_seconds_count", **route) == 2
    assert scrape.value("python_gc_collections_total", process="frontend-1") > 0
    assert {labels["process"] for labels, _ in scrape.samples("python_info")} == {
        "engine-0",
        "frontend-0",
    }
    assert not (tmp_path / "pid-frontend-1.json").exists()
    # forgetting the engine drops its live gauges: readiness, depths, model info, cache
    engine = service["engine-0"]
    engine.exit()
    forget_process(tmp_path, engine.pid)
    scrape = render(tmp_path)
    for name in ("serve_ready", "serve_queue_depth", "serve_model_info",
                 "serve_embedding_cache_bytes", "serve_worker_stuck"):  # fmt: skip
        assert not scrape.samples(name), name
    assert scrape.value("serve_batch_size_count", stage="sam_encoder") == 1
    assert scrape.value("serve_pinned_image_bytes") == 0  # the frontend's own 0


def test_gauge_modes_with_two_engines(tmp_path):
    roles = [Role(tmp_path, name) for name in ("engine-0", "engine-1", "frontend-0")]
    _, engine1, frontend = roles
    try:
        scrape = render(tmp_path)
        assert scrape.value("serve_ready") == 0  # livemin: engine-1 is not warm yet
        assert scrape.value("serve_warmup_seconds") == 4.0  # livemax: the slower one
        assert scrape.value("serve_queue_depth", stage="sam_encoder") == 6  # livesum
        assert scrape.value("serve_embedding_cache_bytes", tier="device") == 2000
        assert scrape.value("serve_compile_cache_events", event="hit") == 6
        assert scrape.value("serve_pinned_image_bytes") == 2 * 4096
        devices = {labels["device"] for labels, _ in scrape.samples("serve_model_info")}
        assert devices == {"cuda:0", "cuda:1"}
        # labelled families: one series per engine, told apart by `engine`
        fidelity = {"model": "sam", "measure": "mask_iou_mean"}
        assert scrape.value("serve_fidelity", engine="0", **fidelity) == 0.25
        assert scrape.value("serve_fidelity", engine="1", **fidelity) == 0.4
        for engine in ("0", "1"):
            assert scrape.value("serve_queue_depth", stage="sam_encoder", engine=engine) == 3
            assert scrape.value("serve_batch_size_count", stage="sam_encoder", engine=engine) == 1
            assert scrape.value("serve_embedding_cache_entries", tier="device", engine=engine) == 2
        # a frontend's families and the unlabelled gauges stay whole-service series
        assert not [labels for labels, _ in scrape.samples("serve_ready") if labels]
        assert not [labels for labels, _ in scrape.samples("serve_rejections_total")
                    if "engine" in labels]  # fmt: skip
        assert scrape.value("serve_worker_stuck", stage="swin") == 0
        engine1.send("stuck")
        stuck = render(tmp_path)
        assert stuck.value("serve_worker_stuck", stage="swin", engine="1") == 1
        assert stuck.value("serve_worker_stuck", stage="swin", engine="0") == 0
        for engine in roles[:2]:
            engine.send("nvml")
        nvml = render(tmp_path)  # the driver's view of a GPU: once, whoever reported it
        assert nvml.samples("serve_gpu_device_used_bytes") == [({"device": "0"}, 100.0)]
        engine1.send("warm")
        assert render(tmp_path).value("serve_ready") == 1
        frontend.send("drain")  # a draining frontend turns the service's readiness off
        assert render(tmp_path).value("serve_ready") == 0
        frontend.exit()
        forget_process(tmp_path, frontend.pid)
        assert render(tmp_path).value("serve_ready") == 1
    finally:
        for role in roles:
            role.exit()


def test_the_folder_must_be_set_before_prometheus_client_is_imported(tmp_path):
    code = (
        "import os, prometheus_client\n"
        f"os.environ['PROMETHEUS_MULTIPROC_DIR'] = {str(tmp_path)!r}\n"
        "from server.metrics import Metrics\n"
        "Metrics('frontend-0')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "must be set before prometheus_client is first imported" in done.stderr
    assert not list(tmp_path.iterdir()), "nothing written"


def test_a_role_is_a_plain_name(tmp_path):
    code = "from server.metrics import Metrics\nMetrics('../engine')\n"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "role '../engine'" in done.stderr
    assert not list(tmp_path.glob("pid-*")), "no pid file outside the naming rule"


def test_gpu_series_are_named_by_the_machine_s_device_index(monkeypatch):
    """Two engines, each pinned to its GPU by CUDA_VISIBLE_DEVICES, both see `cuda:0`: their
    GPU memory series must still differ (livemax would otherwise show only the larger)."""
    from server.engine.gpu_memory import device_label  # torch: the engine's side

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert device_label(0) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert [device_label(0), device_label(1)] == ["2", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [device_label(0), device_label(1)] == ["0", "1"]
