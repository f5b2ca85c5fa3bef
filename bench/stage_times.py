"""Each stage's batches over a load step: how many, their mean wall time on the worker
thread (`serve_batch_duration_seconds`) and their mean span on the GPU stream
(`serve_batch_gpu_seconds`, CUDA only), from two scrapes of the service's `/metrics`.

Why: in issue 19's mix a click's decoder phase took 12.7 ms at the median against 2-3 ms
alone (docs/BENCHMARKS.md). If the decoder's GPU span grows with the wall time, other
engines' kernels held the SMs (MPS has no priority between processes); if the span stays
while the wall time grows, the engine's host side (its GIL, launches) is where it waits.

    python -m bench.stage_times --url http://127.0.0.1:8000 --save /tmp/before.json
    ... load ...
    python -m bench.stage_times --url http://127.0.0.1:8000 --since /tmp/before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import print_table


def stage_sums(metrics_text: str, family: str) -> dict[str, tuple[float, float]]:
    """stage -> (sum, count) of a histogram `family` labelled by stage, summed over the
    engines' series."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for parsed in text_string_to_metric_families(metrics_text):
        if parsed.name != family:
            continue
        for sample in parsed.samples:
            stage = sample.labels.get("stage", "")
            if sample.name == f"{family}_sum":
                sums[stage][0] += sample.value
            elif sample.name == f"{family}_count":
                sums[stage][1] += sample.value
    return {stage: (total, count) for stage, (total, count) in sums.items()}


ENGINE_ITEMS = "items engine "  # the key prefix of an engine's items in `totals`


def engine_items(metrics_text: str) -> dict[str, dict[str, float]]:
    """stage -> `items engine <n>` -> the items engine n's stage took from its queue
    (`serve_queue_wait_seconds`' count, one per item); engine `-` where the service is one
    process (the tests' in-process one has no engine label)."""
    items: dict[str, dict[str, float]] = defaultdict(dict)
    for parsed in text_string_to_metric_families(metrics_text):
        if parsed.name != "serve_queue_wait_seconds":
            continue
        for sample in parsed.samples:
            if sample.name.endswith("_count"):
                key = ENGINE_ITEMS + (sample.labels.get("engine") or "-")
                stage = items[sample.labels.get("stage", "")]
                stage[key] = stage.get(key, 0.0) + sample.value
    return items


def totals(metrics_text: str) -> dict[str, dict[str, float]]:
    """stage -> its batches' count, wall seconds, spans' count and GPU seconds, and the
    items each engine's stage took (`engine_items`)."""
    wall = stage_sums(metrics_text, "serve_batch_duration_seconds")
    gpu = stage_sums(metrics_text, "serve_batch_gpu_seconds")
    per_engine = engine_items(metrics_text)
    return {
        stage: {
            "batches": wall[stage][1],
            "wall_s": wall[stage][0],
            "spans": gpu.get(stage, (0.0, 0.0))[1],
            "gpu_s": gpu.get(stage, (0.0, 0.0))[0],
            **per_engine.get(stage, {}),
        }
        for stage in wall
    }


COLUMNS = ["stage", "batches", "wall ms, mean", "gpu span ms, mean", "items by engine"]


def rows(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per stage that ran a batch between the two scrapes."""
    table = []
    for stage in sorted(after):
        now, then = after[stage], before.get(stage, {})
        delta = {k: v - then.get(k, 0.0) for k, v in now.items()}
        if delta["batches"] <= 0:
            continue
        table.append({
            "stage": stage,
            "batches": int(delta["batches"]),
            "wall ms, mean": 1000 * delta["wall_s"] / delta["batches"],
            "gpu span ms, mean": (
                1000 * delta["gpu_s"] / delta["spans"] if delta["spans"] > 0 else "-"
            ),
            # how evenly the engines shared the stage's work: clicks follow their image
            "items by engine": " ".join(
                f"{key.removeprefix(ENGINE_ITEMS)}:{int(delta[key])}"
                for key in sorted(delta)
                if key.startswith(ENGINE_ITEMS)
            ) or "-",
        })  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--save", type=Path, help="write this scrape's sums here")
    parser.add_argument("--since", type=Path, help="print the stages' batches since this file")
    parser.add_argument("--title", default="", help="a line printed above the table")
    args = parser.parse_args(argv)
    text = httpx.get(args.url.rstrip("/") + "/metrics", timeout=30).text
    now = totals(text)
    if args.save is not None:
        args.save.write_text(json.dumps(now))
    if args.since is not None:
        before = json.loads(args.since.read_text()) if args.since.exists() else {}
        if args.title:
            print(args.title)
        print_table(rows(before, now), COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
