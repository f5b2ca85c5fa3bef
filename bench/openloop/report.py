"""The rows of a step: exact percentiles over all processes' raw samples, the table, JSON.

Per (step, kind), over the measured window [warm-up, warm-up + seconds) of scheduled times:
- sent: requests scheduled in the window; every one is counted once, in `ok` or `errors`;
- ok_per_s: 200s *completed* in the window per second, whenever scheduled: the service's
  throughput (counting 200s by scheduled time would credit a backlog served later);
- p50/p90/p99/max_ms: latency of the window's 200s from their scheduled times
  (nearest-rank percentiles, each an observed latency); errors do not dilute them;
- errors: the window's other outcomes by status ("429", "503", "timeout", "conn_error");
- mean_bytes: mean response body of the 200s;
- lag_p99_ms: how long requests waited in the client before going out on a connection
  (p99): a busy event loop, or every connection busy. Above a few ms the client, not only
  the service, held requests back; the latencies include that wait either way;
- phases_ms: where the 200s' time went, {part: {"p50", "p99", "n"}}: the server's
  `timing_ms` of each response beside the client's lag and the remainders between them,
  per request (phases.py); `phase_table` prints their p50/p99.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.openloop import phases
from bench.openloop.schedule import Sample

OK = "200"
COLUMNS = (
    ("step", "step", "{}"),
    ("kind", "kind", "{}"),
    ("offered/s", "offered_rps", "{:g}"),
    ("sent", "sent", "{}"),
    ("ok/s", "ok_per_s", "{:.1f}"),
    ("p50 ms", "p50_ms", "{:.1f}"),
    ("p90 ms", "p90_ms", "{:.1f}"),
    ("p99 ms", "p99_ms", "{:.1f}"),
    ("max ms", "max_ms", "{:.1f}"),
    ("errors", "errors", "{}"),
    ("mean bytes", "mean_bytes", "{:.0f}"),
    ("lag p99 ms", "lag_p99_ms", "{:.1f}"),
)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q% of the values at or below it;
    NaN for none."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(
    samples: Sequence[Sample], step: str, kind: str, rate: float, warmup_s: float, seconds: float
) -> dict[str, Any]:
    mine = [s for s in samples if s.kind == kind]
    end = warmup_s + seconds
    window = [s for s in mine if warmup_s <= s.scheduled_s < end]
    ok = [s for s in window if s.status == OK]
    done_ok = sum(1 for s in mine if s.status == OK and warmup_s <= s.completed_s < end)
    latencies = sorted(s.latency_s * 1000 for s in ok)
    lags = sorted(s.lag_s * 1000 for s in window)
    errors = Counter(s.status for s in window if s.status != OK)
    return {
        "step": step,
        "kind": kind,
        "offered_rps": rate,
        "seconds": seconds,
        "sent": len(window),
        "ok": len(ok),
        "ok_per_s": done_ok / seconds,
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "max_ms": latencies[-1] if latencies else math.nan,
        "errors": dict(sorted(errors.items())),
        "mean_bytes": sum(s.nbytes for s in ok) / len(ok) if ok else math.nan,
        "lag_p99_ms": percentile(lags, 99),
        "phases_ms": phases.breakdown(
            [(s.latency_s * 1000, s.lag_s * 1000, s.timing_ms) for s in ok], percentile
        ),
    }


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row[key]
    if key == "errors":
        return " ".join(f"{k}:{v}" for k, v in value.items()) or "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, as docs/BENCHMARKS.md holds them."""
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k, f) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def phase_table(rows: Sequence[dict[str, Any]]) -> str:
    """The second table: p50/p99 ms of each part of the 200s' latency, one line per row."""
    note = "p50/p99 ms of each part of the 200s' latency (bench/openloop/phases.py):\n\n"
    return note + phases.table(rows)


def client_cpu_lines(rows: Sequence[dict[str, Any]]) -> str:
    """One line per step: the cores the load's own processes kept busy. On a host the
    server shares (the GPU machine), those cores were not the server's."""
    steps = {r["step"]: r["client_cores"] for r in rows if "client_cores" in r}
    return "".join(f"client cpu during {step}: {c:.2f} cores\n" for step, c in steps.items())


def write_json(path: Path, run: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """NaN (no 200 at all) is written as null, so the file is strict JSON."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"run": run, "rows": [clean(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=1) + "\n")
