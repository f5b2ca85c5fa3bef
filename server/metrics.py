"""Prometheus metrics: fed by the HTTP middleware, the batchers, the cache and the engine.

Two modes, chosen by the environment the process starts in:

- single process (PROMETHEUS_MULTIPROC_DIR unset: tests, `LiveServer`): one in-memory
  registry, rendered as it is, with the standard `process_*`, `python_info` and
  `python_gc_*` families of this process, as the default registry would have them.
- multiprocess (the supervisor sets PROMETHEUS_MULTIPROC_DIR): every process (the engine,
  each frontend) writes its values to files in that folder, and any frontend's `render()`
  merges them all (server/metrics_multiprocess.py), with `process_*` per live process.

Each gauge's `multiprocess_mode` says how the processes' values combine; all are `live*`,
so that a process the supervisor has forgotten stops counting. Nothing is read at scrape
time from another object (`Gauge.set_function` has no multiprocess form): values that no
event sets (pinned image bytes, GPU memory) are pushed by samplers (`add_sampler`).

Histogram buckets resolve 1 ms to 30 s so both a 3 ms decoder call and a cold 20 s request
land in a real bucket rather than +Inf. This module never imports torch: the frontends
build a `Metrics` too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

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

from server.metrics_multiprocess import (
    GcCounters,
    multiprocess_folder,
    register_process,
    render_folder,
)
from server.observers import BatchObserver, CacheObserver
from server.threadnames import name_this_thread

if TYPE_CHECKING:
    from server.domain import ModelInfo

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)

# How often a multiprocess process copies what no event sets (GC counts, pinned bytes,
# GPU memory) into its files: a scrape sees them at most this stale.
SAMPLE_PERIOD_S = 2.0

# The `reason` label of serve_rejections_total: what docs/OBSERVABILITY.md lists.
REJECTION_REASONS = (
    "unauthorized", "queue_full", "cancelled", "not_ready", "deadline", "out_of_memory",
    "bad_input", "internal",
)  # fmt: skip

# The role of the single process that does everything (no PROMETHEUS_MULTIPROC_DIR).
SINGLE = "server"


class Metrics(BatchObserver, CacheObserver):
    """Every metric family the service exports; also the batchers' and cache's observer.

    `role` names the process in multiprocess mode (`engine`, `frontend-0`, ...): the
    `process` label of its `process_*` series. Roles starting with `engine` own
    `serve_ready`; see `ready`.
    """

    def __init__(self, role: str = SINGLE) -> None:
        self.role = role
        self.folder = multiprocess_folder()
        if self.folder is not None:  # first: a bad role writes nothing
            register_process(self.folder, role)
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
        # A frontend's shared pixel memory full: the image travelled inline (one copy
        # more, on the engine's event loop); a sign the engine is behind
        self.pixels_inline = Counter(
            "serve_pixels_inline", "Images sent inline: the frontend's shared memory was full",
            registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "serve_rejections", "Requests refused or dropped, by reason", ["reason"], registry=r
        )
        for reason in REJECTION_REASONS:  # every series from the start, at 0
            self.rejections.labels(reason)
        # Each frontend counts its own requests: the service's are the sum.
        self.in_flight = Gauge(
            "serve_in_flight_requests", "Requests being served (probes and scrapes excluded)",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # Each engine's own pinned buffers (0 in the frontends).
        self.pinned_image_bytes = Gauge(
            "serve_pinned_image_bytes",
            "Page-locked host memory: the frontends' shared pixel files the engine maps "
            "(SERVE_SHM_BYTES_PER_WORKER each; 0 without CUDA)",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.queue_wait = Histogram(
            "serve_queue_wait_seconds", "Time an item waited in a stage's queue",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "serve_batch_duration_seconds", "Computation time of one batch",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_gpu_seconds = Histogram(
            "serve_batch_gpu_seconds",
            "A CUDA batch's span on its stage's stream, from its first queued work to its last "
            "done: against serve_batch_duration_seconds, whether a slow batch waited on the "
            "GPU (this grows) or on the host (it does not)",
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
        # 1 if any engine's stage is stuck.
        self.worker_stuck = Gauge(
            "serve_worker_stuck", "1 while a stage's batch has run past the watchdog timeout",
            ["stage"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        # Items waiting in the stage's queues of every engine.
        self.queue_depth_gauge = Gauge(
            "serve_queue_depth", "Items waiting in a stage's queue", ["stage"], registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.phase_seconds = Histogram(
            "serve_phase_duration_seconds",
            "Time per request phase (image_decode, encode, decode, mask_encode)",
            ["phase"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        # The slowest engine's warm-up (the frontends' 0 never wins).
        self.warmup_seconds = Gauge(
            "serve_warmup_seconds", "Seconds the start-up warm-up took", registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        # Every engine's hits and misses.
        self.compile_cache = Gauge(
            "serve_compile_cache_events", "Inductor FX-graph cache hits and misses at warm-up",
            ["event"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # Measures go both ways (an error, an IoU): neither min nor max is the worst one,
        # so the latest measured, from engines on the same kind of GPU.
        self.fidelity = Gauge(
            "serve_fidelity",
            "The served variant against the fp32 model at start-up (SERVE_FIDELITY_CHECK)",
            ["model", "measure"], registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip
        # 1 per model per engine; the `device` label tells engines apart.
        self.model_info = Gauge(
            "serve_model_info", "Loaded models (value 1)",
            ["name", "weights", "precision", "device", "compile_mode"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.cache_events = Counter(
            "serve_embedding_cache_events",
            "Embedding cache hit, host_hit, miss, eviction, host_eviction",
            ["event"], registry=r,
        )  # fmt: skip
        # Each engine holds its own cache: the service holds the sum.
        self.cache_bytes = Gauge(
            "serve_embedding_cache_bytes", "Bytes of embeddings held, by tier", ["tier"],
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.cache_entries = Gauge(
            "serve_embedding_cache_entries", "Embeddings held, by tier", ["tier"], registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self._phases: dict[str, Histogram] = {}
        self._lock = threading.Lock()
        self._ready: Gauge | None = None
        self._gpu: dict[str, Gauge] = {}
        self._samplers: list[Callable[[], None]] = []
        self._stop = threading.Event()
        if self.folder is None:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
            self.ready.set(0)
            return
        if role.startswith("engine"):
            self.ready.set(0)
        self._samplers.append(GcCounters(r, role))
        threading.Thread(target=self._sample_forever, name="metrics-sampler", daemon=True).start()

    @property
    def ready(self) -> Gauge:
        """`serve_ready`: the least of the processes that set it (`livemin`).

        In multiprocess mode only engines make it at start (at 0, then 1 once warm); a
        frontend makes it only by setting it, when it drains (0). So the service reads 1
        once every engine is warm, and 0 while any loads or any process drains."""
        with self._lock:
            if self._ready is None:
                self._ready = Gauge(
                    "serve_ready", "1 when every model is loaded and warm",
                    registry=self.registry, multiprocess_mode="livemin",
                )  # fmt: skip
            return self._ready

    def phase(self, name: str) -> Histogram:
        """`serve_phase_duration_seconds{phase=name}`, looked up once: a request observes
        up to seven phases, and each `labels()` call takes a lock and builds its key."""
        child = self._phases.get(name)
        if child is None:
            child = self._phases[name] = self.phase_seconds.labels(name)
        return child

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

    def batch_gpu(self, stage: str, seconds: float) -> None:
        self.batch_gpu_seconds.labels(stage).observe(seconds)

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

    def track_engine(self, pinned_image_bytes: Callable[[], int]) -> None:
        """For the engine, once it exists: keep `serve_pinned_image_bytes` and the GPU
        memory families (CUDA only) current, by a sampler (see `add_sampler`)."""
        from server.engine.gpu_memory import sample_gpu_memory  # torch: engine side only

        self.add_sampler(lambda: self.pinned_image_bytes.set(pinned_image_bytes()))
        self.add_sampler(lambda: sample_gpu_memory(self))

    def set_gpu_memory(self, device: str, allocated: float, reserved: float, peak: float) -> None:
        """torch's allocator on `device`: made on first use, so a CPU machine has none."""
        for name, value in (
            ("serve_gpu_memory_allocated_bytes", allocated),
            ("serve_gpu_memory_reserved_bytes", reserved),
            ("serve_gpu_memory_peak_allocated_bytes", peak),
        ):
            self._gpu_gauge(name).labels(device).set(value)

    def set_gpu_device_memory(self, device: str, used: float, total: float) -> None:
        """The driver's view of `device` (NVML, every process on it)."""
        self._gpu_gauge("serve_gpu_device_used_bytes").labels(device).set(used)
        self._gpu_gauge("serve_gpu_device_total_bytes").labels(device).set(total)

    def _gpu_gauge(self, name: str) -> Gauge:
        with self._lock:
            if name not in self._gpu:
                # One engine per device; NVML reports every device to every engine alike.
                self._gpu[name] = Gauge(
                    name, _GPU_HELP[name], ["device"], registry=self.registry,
                    multiprocess_mode="livemax",
                )  # fmt: skip
            return self._gpu[name]

    # -- rendering and samplers -------------------------------------------------------

    def add_sampler(self, sample: Callable[[], None]) -> None:
        """Run `sample` (which sets gauges) now, then before every single-process render,
        or every SAMPLE_PERIOD_S in multiprocess mode (where the render may happen in
        another process). A sampler that raises is logged and dropped."""
        with self._lock:
            self._samplers.append(sample)
        self._run_samplers([sample])

    def render(self) -> bytes:
        """What GET /metrics answers: this process's registry, or every process's files."""
        if self.folder is not None:
            return render_folder(self.folder)
        with self._lock:
            samplers = list(self._samplers)
        self._run_samplers(samplers)
        return generate_latest(self.registry)

    def close(self) -> None:
        """Stop the multiprocess sampler thread (it is a daemon: exiting stops it too)."""
        self._stop.set()

    def _sample_forever(self) -> None:
        name_this_thread()
        while True:
            with self._lock:
                samplers = list(self._samplers)
            self._run_samplers(samplers)
            if self._stop.wait(SAMPLE_PERIOD_S):
                return

    def _run_samplers(self, samplers: list[Callable[[], None]]) -> None:
        for sample in samplers:
            try:
                sample()
            except Exception:
                log.exception("metrics sampler %r failed; dropped", sample)
                with self._lock:
                    if sample in self._samplers:
                        self._samplers.remove(sample)


_GPU_HELP = {
    "serve_gpu_memory_allocated_bytes": "Bytes held by tensors",
    "serve_gpu_memory_reserved_bytes": "Bytes reserved by the caching allocator",
    "serve_gpu_memory_peak_allocated_bytes": "Peak bytes held by tensors",
    "serve_gpu_device_used_bytes": "Device memory in use (NVML, all processes)",
    "serve_gpu_device_total_bytes": "Device memory (NVML)",
}
