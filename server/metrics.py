"""Prometheus metrics: one registry per app, fed by middleware, the batchers and the engine.

Histogram buckets resolve 1 ms to 30 s so both a 3 ms decoder call and a cold 20 s request
land in a real bucket rather than +Inf. The registry also carries the standard `process_*`
(resident memory, CPU seconds, open fds), `python_info` and `python_gc_*` families that the
default registry would have, so the usual dashboards and alerts work on this one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from server.domain import ModelInfo
from server.engine.batcher import BatchObserver
from server.engine.cache import CacheObserver

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


# The `reason` label of serve_rejections_total: what docs/OBSERVABILITY.md lists.
REJECTION_REASONS = (
    "unauthorized", "queue_full", "cancelled", "not_ready", "deadline", "out_of_memory",
    "bad_input", "internal",
)  # fmt: skip


class Metrics(BatchObserver, CacheObserver):
    """Every metric family the service exports; also the batchers' observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_seconds = Histogram(
            "serve_request_duration_seconds", "HTTP request duration by route and status",
            ["route", "method", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "serve_requests", "HTTP requests by route and status",
            ["route", "method", "status"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "serve_rejections", "Requests refused or dropped, by reason", ["reason"], registry=r
        )
        for reason in REJECTION_REASONS:  # every series from the start, at 0
            self.rejections.labels(reason)
        self.in_flight = Gauge(
            "serve_in_flight_requests", "Requests being served (probes and scrapes excluded)",
            registry=r,
        )  # fmt: skip
        self.pinned_image_bytes = Gauge(
            "serve_pinned_image_bytes",
            "Page-locked host memory held by decoded images waiting for the GPU "
            "(at most SERVE_PINNED_IMAGE_BYTES; 0 without CUDA)",
            registry=r,
        )
        self.queue_wait = Histogram(
            "serve_queue_wait_seconds", "Time an item waited in a stage's queue",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "serve_batch_duration_seconds", "Computation time of one batch",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "serve_batch_size", "Items per batch", ["stage"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_failures = Counter(
            "serve_batch_failures", "Batches that raised", ["stage"], registry=r
        )
        self.batch_drops = Counter(
            "serve_batch_drops", "Items refused or dropped by a stage's queue",
            ["stage", "reason"], registry=r,
        )  # fmt: skip
        self.oom_events = Counter(
            "serve_oom_events", "Batches that ran out of device memory (then split)",
            ["stage"], registry=r,
        )  # fmt: skip
        self.worker_stuck = Gauge(
            "serve_worker_stuck", "1 while a stage's batch has run past the watchdog timeout",
            ["stage"], registry=r,
        )  # fmt: skip
        self.queue_depth_gauge = Gauge(
            "serve_queue_depth", "Items waiting in a stage's queue", ["stage"], registry=r
        )
        self.phase_seconds = Histogram(
            "serve_phase_duration_seconds",
            "Time per request phase (image_decode, encode, decode, mask_encode)",
            ["phase"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.warmup_seconds = Gauge(
            "serve_warmup_seconds", "Seconds the start-up warm-up took", registry=r
        )
        self.compile_cache = Gauge(
            "serve_compile_cache_events", "Inductor FX-graph cache hits and misses at warm-up",
            ["event"], registry=r,
        )  # fmt: skip
        self.fidelity = Gauge(
            "serve_fidelity",
            "The served variant against the fp32 model at start-up (SERVE_FIDELITY_CHECK)",
            ["model", "measure"], registry=r,
        )  # fmt: skip
        self.ready = Gauge("serve_ready", "1 when every model is loaded and warm", registry=r)
        self.model_info = Gauge(
            "serve_model_info", "Loaded models (value 1)",
            ["name", "weights", "precision", "device", "compile_mode"], registry=r,
        )  # fmt: skip
        self.cache_events = Counter(
            "serve_embedding_cache_events",
            "Embedding cache hit, host_hit, miss, eviction, host_eviction",
            ["event"], registry=r,
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "serve_embedding_cache_bytes", "Bytes of embeddings held, by tier", ["tier"],
            registry=r,
        )  # fmt: skip
        self.cache_entries = Gauge(
            "serve_embedding_cache_entries", "Embeddings held, by tier", ["tier"], registry=r
        )
        r.register(_TorchMemoryCollector())
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    # -- BatchObserver ----------------------------------------------------------------

    def declare(self, stage: str) -> None:
        """Create the stage's series at 0 now, so that `rate()` sees the first event and
        an autoscaler sees `serve_queue_depth` before any request."""
        self.queue_depth_gauge.labels(stage).set(0)
        self.worker_stuck.labels(stage).set(0)
        self.batch_failures.labels(stage)
        self.oom_events.labels(stage)

    def queue_depth(self, stage: str, depth: int) -> None:
        self.queue_depth_gauge.labels(stage).set(depth)

    def batch_started(self, stage: str, size: int, cost: int, waits_s: Sequence[float]) -> None:
        self.batch_size.labels(stage).observe(size)
        for wait in waits_s:
            self.queue_wait.labels(stage).observe(wait)

    def batch_finished(self, stage: str, size: int, seconds: float, failed: bool) -> None:
        self.batch_seconds.labels(stage).observe(seconds)
        if failed:
            self.batch_failures.labels(stage).inc()

    def rejected(self, stage: str, reason: str) -> None:
        # per stage; requests are counted once, by the HTTP layer, in serve_rejections
        self.batch_drops.labels(stage, reason).inc()

    def out_of_memory(self, stage: str, size: int) -> None:
        self.oom_events.labels(stage).inc()

    # -- CacheObserver ----------------------------------------------------------------

    def cache_event(self, event: str) -> None:
        self.cache_events.labels(event).inc()

    def cache_size(self, tier: str, entries: int, nbytes: int) -> None:
        self.cache_entries.labels(tier).set(entries)
        self.cache_bytes.labels(tier).set(nbytes)

    # -- engine ---------------------------------------------------------------------

    def set_models(self, models: Sequence[ModelInfo]) -> None:
        for m in models:
            self.model_info.labels(m.name, m.weights, m.precision, m.device, m.compile_mode).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TorchMemoryCollector(Collector):
    """GPU memory as torch's allocator sees it, read at scrape time."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not torch.cuda.is_available():
            return
        families = {
            "allocated": GaugeMetricFamily(
                "serve_gpu_memory_allocated_bytes", "Bytes held by tensors", labels=["device"]
            ),
            "reserved": GaugeMetricFamily(
                "serve_gpu_memory_reserved_bytes", "Bytes reserved by the caching allocator",
                labels=["device"],
            ),
            "peak": GaugeMetricFamily(
                "serve_gpu_memory_peak_allocated_bytes", "Peak bytes held by tensors",
                labels=["device"],
            ),
        }  # fmt: skip
        for index in range(torch.cuda.device_count()):
            label = [str(index)]
            families["allocated"].add_metric(label, torch.cuda.memory_allocated(index))
            families["reserved"].add_metric(label, torch.cuda.memory_reserved(index))
            families["peak"].add_metric(label, torch.cuda.max_memory_allocated(index))
        yield from families.values()
        yield from _nvml_families()


def _nvml_families() -> Iterator[GaugeMetricFamily]:
    """Device memory as the driver sees it (all processes), when nvidia-ml-py is installed."""
    try:
        import pynvml  # nvidia-ml-py: optional, present in CUDA images
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return
    used = GaugeMetricFamily(
        "serve_gpu_device_used_bytes", "Device memory in use (NVML, all processes)",
        labels=["device"],
    )  # fmt: skip
    total = GaugeMetricFamily(
        "serve_gpu_device_total_bytes", "Device memory (NVML)", labels=["device"]
    )
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            used.add_metric([str(index)], float(info.used))
            total.add_metric([str(index)], float(info.total))
    except pynvml.NVMLError:
        return
    finally:
        pynvml.nvmlShutdown()
    yield used
    yield total
