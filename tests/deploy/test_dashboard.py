"""The Grafana dashboard (k8s/grafana): JSON that Grafana loads, the panels an operator of the
service needs, PromQL that queries only metrics a real server exports, and its ConfigMap for
Grafana's dashboard sidecar, rendered by kustomize and validated like the other manifests.

Metric names are taken from every PromQL expression with a regex and compared with a real
`/metrics` scrape of a LiveServer. GPU memory families cannot appear on a CPU machine; they
are the ones the engine's GPU sampler (server/engine/gpu_memory.py) sets when run here with
a pretend GPU and a pretend nvidia-ml-py, so the exception list comes from the code, not
from this file.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.engine.gpu_memory import sample_gpu_memory
from server.metrics import Metrics
from tests.deploy.conftest import K8S, REPO, TARGETS
from tests.deploy.test_k8s import KUBERNETES_VERSIONS
from tests.server.conftest import LiveServer, small_settings

GRAFANA = K8S / "grafana"
DASHBOARD = GRAFANA / "dashboard.json"
# the service's own families and the standard process_* ones it exports beside them
METRIC = re.compile(r"\b(?:serve|process)_[a-zA-Z0-9_:]*")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SAMPLE_SUFFIXES = {  # what a family of each type exposes, as PromQL sees it
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}

# Panel title -> patterns its PromQL must match: the panels issue 6 asks for.
REQUIRED: dict[str, tuple[str, ...]] = {
    "Throughput by route": (r"sum by \(route\) \(rate\(serve_requests_total\{",),
    "Latency p50 / p95 / p99": tuple(
        rf"histogram_quantile\({q}, sum by \(le, route\) \(rate\("
        r"serve_request_duration_seconds_bucket\{"
        for q in ("0.5", "0.95", "0.99")
    ),
    "Queue depth by stage": (r"sum by \(stage\) \(serve_queue_depth\{",),
    "Queue wait p99 by stage": (
        r"histogram_quantile\(0.99, sum by \(le, stage\) \(rate\(serve_queue_wait_seconds_bucket",
    ),
    "Mean batch size by stage": (
        r"rate\(serve_batch_size_sum\{.*/ sum by \(stage\) \(rate\(serve_batch_size_count\{",
    ),
    "Batch duration and GPU span p99 by stage": (
        r"histogram_quantile\(0.99, sum by \(le, stage\) \(rate\("
        r"serve_batch_duration_seconds_bucket",
        r"histogram_quantile\(0.99, sum by \(le, stage\) \(rate\(serve_batch_gpu_seconds_bucket",
    ),
    "GPU memory": (
        r"serve_gpu_memory_allocated_bytes\{",
        r"serve_gpu_memory_reserved_bytes\{",
        r"serve_gpu_device_used_bytes\{",
        r"serve_gpu_device_total_bytes\{",
    ),
    "Errors and rejections by reason": (
        r"sum by \(reason\) \(rate\(serve_rejections_total\{",
        r'serve_requests_total\{[^}]*status=~"5\.\."',
    ),
    "Out-of-memory events": (r"increase\(serve_oom_events_total\{",),
    "Worker stuck": (r"max by \(pod, stage\) \(serve_worker_stuck\{",),
    "Embedding cache hit ratio": (
        r'serve_embedding_cache_events_total\{[^}]*event=~"hit\|host_hit"\}.*/ '
        r'.*serve_embedding_cache_events_total\{[^}]*event=~"hit\|host_hit\|miss"\}',
    ),
    "Embedding cache bytes": (r"sum by \(pod, tier\) \(serve_embedding_cache_bytes\{",),
    "Warm-up seconds per pod": (r"max by \(pod\) \(serve_warmup_seconds\{",),
    "Ready per pod": (r"max by \(pod\) \(serve_ready\{",),
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' own panels included (a collapsed row holds its panels)."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and template variable queries."""
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def queried_names(board: dict[str, Any]) -> set[str]:
    return {name for expr in queries(board) for name in METRIC.findall(expr)}


def family_of(name: str) -> str:
    """The family a sample name belongs to: `_bucket`, `_sum`, `_count`, `_total` stripped."""
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def sample_names(families: dict[str, str]) -> set[str]:
    """The names PromQL can select for families {name: type}."""
    return {name + suffix for name, kind in families.items() for suffix in SAMPLE_SUFFIXES[kind]}


@pytest.fixture(scope="module")
def scraped_all() -> Iterator[dict[str, str]]:
    """{family: type} of a real /metrics scrape of a live server (tiny models, CPU)."""
    server = LiveServer(small_settings()).start()
    try:
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    yield {f.name: f.type for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def scraped(scraped_all: dict[str, str]) -> dict[str, str]:
    """The service's own families: the standard process_* and python_* ones are the client
    library's (tests/server/test_metrics.py checks them; no panel has to show them all)."""
    return {name: kind for name, kind in scraped_all.items() if name.startswith("serve_")}


class _FakeNvml(types.ModuleType):
    """Enough of nvidia-ml-py for the sampler: one device, 1 of 2 bytes used."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")

    def nvmlInit(self) -> None: ...  # noqa: N802 (pynvml's names)

    def nvmlShutdown(self) -> None: ...  # noqa: N802

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(used=1, total=2, free=1)


@pytest.fixture(scope="module")
def cuda_families() -> dict[str, str]:
    """{family: type} that server.metrics exports only on CUDA: its registry collected after
    the engine's GPU sampler ran with a pretend GPU (torch.cuda answering as one device
    would) and a pretend nvidia-ml-py, minus what it exports here after the same sampler."""
    plain_metrics = Metrics()
    sample_gpu_memory(plain_metrics)
    plain = {f.name: f.type for f in plain_metrics.registry.collect()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                     "device_memory_used"):  # fmt: skip
            patch.setattr(torch.cuda, name, lambda device=None: 1, raising=False)
        patch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 2), raising=False)
        patch.setitem(sys.modules, "pynvml", _FakeNvml())
        gpu_metrics = Metrics()
        sample_gpu_memory(gpu_metrics)
        with_gpu = {f.name: f.type for f in gpu_metrics.registry.collect()}
    return {name: kind for name, kind in with_gpu.items() if name not in plain}


# -- the dashboard ----------------------------------------------------------------------


def test_dashboard_is_grafana_json_with_a_prometheus_datasource_variable(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard.get("id") is None, "no instance-specific id: provisioning assigns one"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for name in ("namespace", "pod"):
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert variable["includeAll"] and variable["allValue"] == ".*", "All matches no label too"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what it shows"


def test_panels_tile_the_grid_without_overlap(dashboard):
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:  # top level: rows and the panels of open rows
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] >= 1 and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_required_panels_are_there(dashboard):
    by_title = {p["title"]: p for p in panels(dashboard)}
    missing = set(REQUIRED) - set(by_title)
    assert not missing, f"missing panels: {sorted(missing)}"
    for title, patterns in REQUIRED.items():
        exprs = "\n".join(t["expr"] for t in by_title[title]["targets"])
        for pattern in patterns:
            assert re.search(pattern, exprs), f"{title}: no query matches {pattern}\n{exprs}"


def test_every_query_selects_the_chosen_pods_and_rate_interval(dashboard):
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            selectors = re.findall(r"\b((?:serve|process)_[a-zA-Z0-9_:]*)(\{[^}]*\})?", expr)
            assert selectors, f"{panel['title']}: {expr}"
            for name, matchers in selectors:
                assert 'namespace=~"$namespace"' in matchers, f"{panel['title']}: {name}"
                assert 'pod=~"$pod"' in matchers, f"{panel['title']}: {name}"
            ranges = re.findall(r"\[([^\]]*)\]", expr)
            assert all(r == "$__rate_interval" for r in ranges), f"{panel['title']}: {ranges}"
            assert expr.count("(") == expr.count(")"), f"{panel['title']}: {expr}"


def test_promql_parses(dashboard):
    import promql_parser  # a dev dependency: CI must parse every query, not skip

    for expr in queries(dashboard):
        if expr.startswith("label_values("):  # Grafana's variable function, not PromQL
            expr = expr[len("label_values(") : expr.rindex(",")]
        concrete = (
            expr.replace("$__rate_interval", "1m").replace("$namespace", ".*").replace("$pod", ".*")
        )
        promql_parser.parse(concrete)


# -- the metrics it queries -------------------------------------------------------------


def test_cuda_families_come_from_the_sampler(cuda_families):
    # The pretend GPU reached both the torch allocator's families and NVML's.
    assert cuda_families, "the GPU sampler set nothing with a pretend GPU"
    assert set(cuda_families.values()) == {"gauge"}
    assert all(name.startswith("serve_gpu_") for name in cuda_families)
    source = (REPO / "server" / "metrics.py").read_text()
    assert set(re.findall(r'"(serve_gpu_[a-z_]+)"', source)) == set(cuda_families)


def test_every_queried_metric_is_exported(dashboard, scraped_all, cuda_families):
    names = queried_names(dashboard)
    assert names, "the dashboard queries serve_ metrics"
    assert {n for n in names if n.startswith("process_")}, "and the process' own"
    unknown = names - sample_names(scraped_all) - sample_names(cuda_families)
    assert not unknown, f"queried but never exported (or with the wrong suffix): {unknown}"
    absent = {family_of(name) for name in names - sample_names(scraped_all)}
    if torch.cuda.is_available():  # NVML's two are missing there without nvidia-ml-py
        assert absent <= set(cuda_families), absent
    else:
        # the families missing from a CPU scrape are exactly the GPU sampler's, and the
        # GPU memory panel shows every one of them
        assert absent == set(cuda_families)


def test_every_exported_family_is_on_the_dashboard(dashboard, scraped, cuda_families):
    # every serve_ family (of the standard ones, only memory, CPU and fds have panels)
    shown = {family_of(name) for name in queried_names(dashboard)}
    exported = {family_of(name) for name in sample_names(scraped | cuda_families)}
    assert exported - shown == set(), "families no panel shows"


# -- the ConfigMap ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard_manifests(kubectl: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [kubectl, "kustomize", str(GRAFANA)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"kustomize {GRAFANA}: {proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def test_config_map_carries_the_dashboard_for_the_sidecar(dashboard_manifests, dashboard):
    (config,) = dashboard_manifests
    assert config["kind"] == "ConfigMap"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["name"] == "sam-swin-serve-dashboard", "no hash suffix"
    ((key, text),) = config["data"].items()
    assert key == "sam-swin-serve.json", "a file name no other dashboard uses"
    assert json.loads(text) == dashboard
    # kubectl apply (client side) keeps a copy in an annotation, limited to 256 KiB
    assert len(json.dumps(config)) < 256 * 1024


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_config_map_matches_the_kubernetes_schema(dashboard_manifests, version):
    for obj in dashboard_manifests:
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_kustomization_under_k8s_is_rendered_by_a_test():
    rendered = {Path(p).resolve() for p in TARGETS.values()} | {GRAFANA.resolve()}
    found = {p.parent.resolve() for p in K8S.rglob("kustomization.yaml")}
    assert found <= rendered, f"never rendered: {sorted(map(str, found - rendered))}"


def test_every_exported_metric_is_documented(scraped_all, cuda_families):
    doc = (REPO / "docs" / "OBSERVABILITY.md").read_text()
    families = scraped_all | cuda_families
    exposed = {name + ("_total" if kind == "counter" else "") for name, kind in families.items()}
    missing = sorted(name for name in exposed if f"`{name}`" not in doc)
    assert not missing, f"docs/OBSERVABILITY.md does not describe {missing}"
