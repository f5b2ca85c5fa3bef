"""One click's decoder batch at a fixed pace, against the same batch back to back: how much
of a lone click's engine time is the GPU idling between clicks, not the click's work.

Why: at clicks @100/s the service's decoder batches took 3.0 ms of wall time and 2.1 ms of
GPU time at the median (docs/BENCHMARKS.md, issue 19, twenty-fifth session), where
`bench.decoder_batch`, which runs the same batch back to back, measured the whole batch
at 1.35 ms and its graph at 0.5 (H200). Between clicks 10 ms apart the GPU is idle for
most of the time; if its clocks fall meanwhile, each click runs at the lower clock, and no
code change to the decoder shows in the service until that is known.

Per pace (0: back to back) this times `SamStages.decode` of one one-point multimask click
(the service's path: the decoder graph, the runs from the low-res logits, the copies
back; `decode-counted`: the same with the runs counted before their copy, two waits for
the GPU where the service waits once, `server.engine.runs.RunsCapacity`): wall time, GPU
span (events on the current stream, which the decoder uses), and the SM clock and power
that `nvidia-smi` reports every 50 ms meanwhile. `--cuda-wait`
sets the engine's wait mode first, as `SERVE_CUDA_WAIT` does (server/engine/cuda_wait.py).

    python -m bench.click_pace --images .benchdata/images --paces-ms 0 10 --seconds 4
    python -m bench.click_pace --images .benchdata/images --paces-ms 0 10 --clicks 8 \
        --rotate --forms decode decode-counted    # the runs' room as the service learns it
    SERVE_DEVICE=cpu python -m bench.click_pace --paces-ms 0 5 --seconds 0.5
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_IMAGES, environment, print_table
from server.engine.cuda_wait import CudaWait, cuda_wait_mode, set_cuda_wait

__all__ = ["ClockSampler", "paced"]


class ClockSampler:
    """`nvidia-smi`'s SM clock (MHz) and power (W) every `period_ms`, in a child process,
    between `start()` and `stop()`; nothing where the program is missing (the CPU)."""

    def __init__(self, period_ms: int = 50) -> None:
        self.period_ms = period_ms
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             f"-lms={self.period_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def stop(self) -> dict[str, float]:
        """The samples' median and range, or {} with no sampler."""
        if self._proc is None:
            return {}
        self._proc.terminate()
        out, _ = self._proc.communicate()
        self._proc = None
        clocks, watts = [], []
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                clocks.append(float(fields[0]))
                watts.append(float(fields[1]))
            except (IndexError, ValueError):
                continue  # a header or a cut line
        if not clocks:
            return {}
        return {"sm_mhz_p50": statistics.median(clocks), "sm_mhz_min": min(clocks),
                "sm_mhz_max": max(clocks), "watts_p50": statistics.median(watts)}  # fmt: skip


def paced(
    fn: Any, pace_ms: float, seconds: float, gpu: bool, idle: str = "sleep"
) -> dict[str, float]:
    """`fn` once every `pace_ms` (open loop: a late call goes at once; 0: back to back) for
    `seconds`: wall and GPU span percentiles in ms. `idle`: how the thread waits between
    calls, asleep (as an engine's thread waits for work) or `spin`ning on its core (the
    core kept awake: if that closes the gap to back to back, the host's idle states made
    it)."""
    import torch

    walls: list[float] = []
    spans: list[float] = []
    start = torch.cuda.Event(enable_timing=True) if gpu else None
    end = torch.cuda.Event(enable_timing=True) if gpu else None
    deadline = time.perf_counter() + seconds
    next_at = time.perf_counter()
    while next_at < deadline or len(walls) < 3:
        if pace_ms > 0 and idle == "spin":
            while time.perf_counter() < next_at:
                pass
        elif pace_ms > 0:
            time.sleep(max(0.0, next_at - time.perf_counter()))
        began = time.perf_counter()
        if start is not None:
            start.record()
        fn()  # returns with its results on the host: the decoder waited for the GPU
        if start is not None and end is not None:
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end))
        walls.append((time.perf_counter() - began) * 1e3)
        next_at = max(next_at + pace_ms / 1e3, began) if pace_ms > 0 else time.perf_counter()
    row = {"calls": float(len(walls)), **_cuts("wall", walls)}
    if spans:
        row.update(_cuts("gpu", spans))
    return row


def _cuts(name: str, values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return {f"{name}_p50": cuts[49], f"{name}_p99": cuts[98]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--paces-ms", type=float, nargs="+", default=[0.0, 10.0])
    p.add_argument("--seconds", type=float, default=4.0, help="per pace")
    p.add_argument("--cuda-wait", default=None, help="SERVE_CUDA_WAIT's values; unset: CUDA's")
    p.add_argument("--clicks", type=int, default=1, help="clicks in the batch, each its photo")
    p.add_argument("--idle", nargs="+", choices=["sleep", "spin"], default=["sleep"])
    p.add_argument(
        "--rotate",
        action="store_true",
        help="each call's clicks start one photo further on, so photos of every size\n"
        "follow each other as in the service (the runs' room learns from the\n"
        "batches before: the same photos every call would keep it right)",
    )
    p.add_argument(
        "--forms",
        nargs="+",
        choices=["decode", "decode-counted", "graph"],
        default=["decode"],
        help="decode: the whole batch as served; decode-counted: the same with the runs\n"
        "counted before their copy back (two waits for the GPU, the path before\n"
        "RunsCapacity); graph: its decoder graph's replay",
    )
    args = p.parse_args()
    wait: CudaWait | None = None
    if args.cuda_wait is not None:  # before anything makes the CUDA context
        wait = cuda_wait_mode(args.cuda_wait)
        refused = set_cuda_wait(wait)
        if refused:
            print(f"SERVE_CUDA_WAIT={args.cuda_wait} not set: {refused}", flush=True)

    import torch

    from bench.decoder_batch import click_items, warm_stages

    env = environment()
    print(env, flush=True)
    stages, entries, settings = warm_stages(args.images, None)
    turns = [
        click_items(entries[k:] + entries[:k], args.clicks, args.clicks, 1)
        for k in range(len(entries) if args.rotate else 1)
    ]
    batches = itertools.cycle(turns)
    gpu = stages.device.type == "cuda"

    def decode() -> object:
        return stages.decode(next(batches))

    def counted() -> object:
        kept, stages.runs_capacity = stages.runs_capacity, None
        try:
            return decode()
        finally:
            stages.runs_capacity = kept

    forms: dict[str, Callable[[], object]] = {"decode": decode, "decode-counted": counted}
    graphs = stages._graphs
    if "graph" in args.forms and graphs is not None:  # the click's bucket, as it replays
        bucket = graphs.bucket(args.clicks, 2)
        captured = graphs._captured[bucket] if bucket is not None else None
        if captured is not None and captured.graph is not None:
            forms["graph"] = captured.graph.replay
    rows = []
    with torch.inference_mode():
        for _ in range(max(5, len(turns))):  # every turn's photos once at least
            decode()
        for form, idle, pace in itertools.product(args.forms, args.idle, args.paces_ms):
            if form not in forms:
                continue
            sampler = ClockSampler()
            sampler.start()
            row = paced(forms[form], pace, args.seconds, gpu, idle)
            rows.append({"model": settings.sam_model, "clicks": args.clicks, "form": form,
                         "rotate": args.rotate, "cuda_wait": wait or "cuda", "idle": idle,
                         "pace_ms": pace, **row,
                         **sampler.stop()})  # fmt: skip
            print(rows[-1], flush=True)
    capacity = stages.runs_capacity
    if capacity is not None:  # batches whose runs outgrew their room: a second copy each
        print(
            f"runs' room: {capacity.room(1, 1 << 40) - 1} a mask, {capacity.overflows} "
            f"overflows, {capacity.chars_overflows} of the strings' characters"
        )
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
