"""One `/metrics` for every process of the service: prometheus_client's multiprocess mode.

The supervisor points PROMETHEUS_MULTIPROC_DIR at a fresh folder before it starts any
process. Every metric value is then an entry in a per-pid file there (`counter_<pid>.db`,
`gauge_livesum_<pid>.db`, ...), and any process renders the whole service by merging the
files (`MultiProcessCollector`): counters and histograms add up, each gauge as its
`multiprocess_mode` says.

What cannot live in those files is read here at render time: the `process_*` families of
every live process, from /proc/<pid>, labelled `process="<role>"`, and `python_info`. Each
process says it exists with `pid-<role>.json` (`register_process`); the supervisor calls
`forget_process` once it has reaped one, which drops the file and the dead pid's `live*`
gauges (its counters stay: they are the service's history, and `rate()` needs them to stay
monotonic).

With several engines (one per GPU) their labelled families (stage, cache tier, model...)
carry an `engine` label, the index in the engine's role, so that one GPU's queue or cache
shows on its own (`EngineCollector`); a sum over it gives the service's. Unlabelled gauges
keep their service-wide meaning (`serve_ready`: the least; `serve_warmup_seconds`: the
slowest; `serve_pinned_image_bytes`: the sum), and so do the frontends' families.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    ProcessCollector,
    generate_latest,
    values,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"  # also what prometheus_client reads, at its import
ROLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PID_FILE = "pid-{role}.json"


def multiprocess_folder() -> Path | None:
    """The folder every process writes its metrics to, or None in single-process mode.

    prometheus_client picks its value class (in-memory or file-backed) when it is first
    imported, from the same variable: a process that set it later would count in memory
    while rendering the files, so that mix-up fails here, loudly."""
    folder = os.environ.get(ENV)
    file_backed = bool(getattr(values.ValueClass, "_multiprocess", False))
    if not folder:
        if file_backed:
            raise RuntimeError(f"{ENV} was unset after prometheus_client was imported")
        return None
    if not file_backed:
        raise RuntimeError(f"{ENV} must be set before prometheus_client is first imported")
    path = Path(folder)
    if not path.is_dir():
        raise RuntimeError(f"{ENV}={folder} is not a directory")
    return path


@dataclass(frozen=True)
class ProcessEntry:
    """One process of the service, as its pid file says."""

    role: str
    pid: int
    start_ticks: int | None  # /proc/<pid>/stat's start time: tells a reused pid apart
    python: dict[str, str]


def register_process(folder: Path, role: str) -> Path:
    """Write `pid-<role>.json` for this process (atomically: a render never reads half).

    A restarted process of the same role replaces its predecessor's file."""
    if not ROLE.fullmatch(role):
        raise ValueError(f"role {role!r}: letters, digits, '_', '.', '-' (64 at most)")
    pid = os.getpid()
    entry = {
        "role": role,
        "pid": pid,
        "start_ticks": _start_ticks(pid),
        "python": {
            "implementation": platform.python_implementation(),
            "major": platform.python_version_tuple()[0],
            "minor": platform.python_version_tuple()[1],
            "patchlevel": platform.python_version_tuple()[2],
            "version": platform.python_version(),
        },
    }
    path = folder / _PID_FILE.format(role=role)
    partial = folder / f".{path.name}.{pid}.tmp"
    partial.write_text(json.dumps(entry))
    os.replace(partial, path)
    return path


def forget_process(folder: str | os.PathLike[str], pid: int) -> None:
    """For the supervisor, once it has reaped `pid`: its `live*` gauges (in-flight, queue
    depths, readiness, model info, cache bytes...) leave every later render, and so do its
    `process_*` series. Its counters and histograms stay, as prometheus_client intends."""
    path = Path(folder)
    mark_process_dead(pid, str(path))
    for entry_path, entry in _entries(path):
        if entry.pid == pid:
            entry_path.unlink(missing_ok=True)


def live_processes(folder: Path) -> list[ProcessEntry]:
    """The registered processes still running (not reaped, and not a reused pid)."""
    # without /proc (start_ticks None) the file is trusted
    alive = [
        entry
        for _, entry in _entries(folder)
        if entry.start_ticks is None or _start_ticks(entry.pid) == entry.start_ticks
    ]
    return sorted(alive, key=lambda e: e.role)


def render_folder(folder: Path) -> bytes:
    """The exposition text of every process writing to `folder`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(folder))
    registry.register(ServiceProcessCollector(folder))
    return generate_latest(registry)


# No `engine` label: families an engine writes too (every process makes their series at 0)
# that are the frontends' or the whole service's; the driver's view of each GPU (NVML),
# which every engine reports alike for every device (a label would multiply it in a sum);
# and `python_gc_*`, which carry the `process` label already.
_SERVICE_FAMILIES = frozenset({"serve_rejections", "serve_requests",
                               "serve_request_duration_seconds",
                               "serve_phase_duration_seconds",
                               "serve_gpu_device_used_bytes",
                               "serve_gpu_device_total_bytes"})  # fmt: skip
_NOT_A_LABEL = frozenset({"le", "pid"})


class EngineCollector(MultiProcessCollector):
    """prometheus_client's merge of the files, with each live engine's labelled samples
    labelled `engine="<index>"` before they are merged (so they stay apart).

    A file's pid is the last part of its name (`counter_<pid>.db`, `gauge_livesum_<pid>.db`);
    an engine's pid is known from its `pid-engine-<i>.json`. Files of any other pid (the
    frontends, a forgotten process) merge as prometheus_client merges them."""

    def __init__(self, folder: Path) -> None:
        super().__init__(None, path=str(folder))
        self.folder = folder

    def collect(self) -> Iterator[Metric]:
        engines = {
            str(e.pid): e.role.removeprefix("engine-")
            for e in live_processes(self.folder)
            if e.role.startswith("engine")
        }
        groups: dict[str | None, list[str]] = {}
        for path in self.folder.glob("*.db"):
            pid = path.stem.rsplit("_", 1)[-1]
            groups.setdefault(engines.get(pid), []).append(str(path))
        merged: dict[str, Metric] = {}
        for engine, files in groups.items():
            for name, family in self._read_metrics(files).items():
                own = name not in _SERVICE_FAMILIES and not name.startswith("python_")
                if engine is not None and own:
                    _label_engine(family, engine)
                into = merged.setdefault(name, family)
                if into is not family:
                    into.samples += family.samples
        yield from self._accumulate_metrics(merged, True)


def _label_engine(family: Metric, engine: str) -> None:
    """`engine=<index>` on the samples of a labelled family (a histogram's `le` and a
    gauge's `pid` are not labels of its own). Before the merge a sample's labels are still
    a tuple of pairs, which the merge groups by (prometheus_client's `_read_metrics`)."""
    pairs = [cast(tuple[tuple[str, str], ...], sample.labels) for sample in family.samples]
    if not any(key not in _NOT_A_LABEL for labels in pairs for key, _ in labels):
        return
    family.samples = [
        sample._replace(labels=cast(dict[str, str], (*labels, ("engine", engine))))
        for sample, labels in zip(family.samples, pairs, strict=True)
    ]


class ServiceProcessCollector(Collector):
    """`process_*` and `python_info` for each live process, labelled with its role."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        info = Metric("python_info", "Python platform information", "gauge")
        for entry in live_processes(self.folder):
            reader = ProcessCollector(pid=_fixed(entry.pid), registry=None)
            for family in reader.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "process": entry.role}
                    merged.add_sample(sample.name, labels, sample.value)
            info.add_sample("python_info", {**entry.python, "process": entry.role}, 1.0)
        yield from families.values()
        if info.samples:
            yield info


class GcCounters:
    """`python_gc_*` of one process, copied into the shared files (`GCCollector` reads
    `gc.get_stats()` of the process that answers the scrape, which would make every
    frontend's counters jump to another's).

    Called periodically, never from a `gc.callbacks` hook: the file-backed values take a
    lock that a collection triggered inside that lock would wait on forever."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        labels = ["generation", "process"]
        self.collected = Counter(
            "python_gc_objects_collected", "Objects collected during gc", labels,
            registry=registry,
        )  # fmt: skip
        self.uncollectable = Counter(
            "python_gc_objects_uncollectable", "Uncollectable objects found during GC", labels,
            registry=registry,
        )  # fmt: skip
        self.collections = Counter(
            "python_gc_collections", "Number of times this generation was collected", labels,
            registry=registry,
        )  # fmt: skip
        self.role = role
        self.seen = [(0, 0, 0) for _ in gc.get_stats()]

    def __call__(self) -> None:
        for generation, stat in enumerate(gc.get_stats()):
            now = (stat["collected"], stat["uncollectable"], stat["collections"])
            counters = (self.collected, self.uncollectable, self.collections)
            for counter, new, old in zip(counters, now, self.seen[generation], strict=True):
                counter.labels(str(generation), self.role).inc(new - old)
            self.seen[generation] = now


def _entries(folder: Path) -> Iterator[tuple[Path, ProcessEntry]]:
    for path in folder.glob(_PID_FILE.format(role="*")):
        try:
            raw = json.loads(path.read_text())
            entry = ProcessEntry(
                role=str(raw["role"]), pid=int(raw["pid"]),
                start_ticks=None if raw["start_ticks"] is None else int(raw["start_ticks"]),
                python={str(k): str(v) for k, v in raw["python"].items()},
            )  # fmt: skip
        except FileNotFoundError:  # forgotten meanwhile
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring the unreadable process file %s: %s", path, exc)
            continue
        yield path, entry


def _fixed(pid: int) -> Callable[[], int]:
    return lambda: pid


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None without /proc or pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])
