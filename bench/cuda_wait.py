"""The host cores that threads waiting for the GPU use, and how late they wake, by
`SERVE_CUDA_WAIT` mode (server/engine/cuda_wait.py).

Why: with six engines on a GPU, classify @2,000/s collapsed where two engines held it,
with the GPU under 40% busy and the frontends' event loops late; each engine has a thread
per stage waiting on its stream, and CUDA's default wait spins a core. This runs what an
engine's stage threads do, without the service: `--processes` processes (engines), each
with `--threads` threads on streams of their own (stages), each repeatedly queuing a GPU
product of about `--work-ms` and waiting for it, for `--seconds`. Per mode it prints the
cores the processes kept busy (their CPU seconds over the wall seconds), each wait's
overshoot (from the GPU's end of the work, an event, to the thread's return: the wake-up),
and the products done per second (the GPU's share). Then a lone thread times a tiny
kernel's launch-and-wait round trip, the cost a click pays per wait. The mode `cuda`
gives the context no flag (CUDA's own heuristic, which spins on a host of this size).

    python -m bench.cuda_wait --processes 6 --threads 3 --seconds 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import threading
import time
from typing import Any

from bench.common import environment, print_table
from server.engine.cuda_wait import cuda_wait_mode, set_cuda_wait


def _calibrate(torch: Any, size: int, work_ms: float) -> int:
    """Products of `size` squared that take about `work_ms` on this GPU."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    each_ms = (time.perf_counter() - start) * 100.0
    return max(1, round(work_ms / each_ms))


def _stage(torch: Any, repeats: int, size: int, until: float, out: list[float]) -> None:
    """One stage thread: queue the work, wait for it, note how late the wait returned."""
    stream = torch.cuda.Stream()
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    done = torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        while time.perf_counter() < until:
            start.record(stream)
            for _ in range(repeats):
                a @ a
            done.record(stream)
            queued = time.perf_counter()
            stream.synchronize()
            returned = time.perf_counter()
            # the GPU's time for the work; what the wait took beyond it is the overshoot
            gpu_s = start.elapsed_time(done) / 1000.0
            out.append(max(0.0, returned - queued - gpu_s) * 1e6)


def _engine(mode: str, threads: int, seconds: float, work_ms: float, queue: Any) -> None:
    # "cuda": the context as CUDA makes it, no flag given (its heuristic spins here)
    why_not = None if mode == "cuda" else set_cuda_wait(cuda_wait_mode(mode))
    import torch

    size = 2048
    repeats = _calibrate(torch, size, work_ms)
    overshoots: list[list[float]] = [[] for _ in range(threads)]
    until = time.perf_counter() + seconds
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    workers = [
        threading.Thread(target=_stage, args=(torch, repeats, size, until, overshoots[i]))
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # the round trip of a tiny kernel on a lone thread: what a short wait costs
    x = torch.ones(16, device="cuda")
    trips = []
    for _ in range(300):
        t = time.perf_counter()
        x.add_(1.0)
        torch.cuda.current_stream().synchronize()
        trips.append((time.perf_counter() - t) * 1e6)
    queue.put({
        "why_not": why_not,
        "cpu_per_wall": cpu / wall,
        "overshoot_us": [v for o in overshoots for v in o],
        "waits": sum(len(o) for o in overshoots),
        "wall": wall,
        "trip_us": trips[50:],
    })  # fmt: skip


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(
            target=_engine, args=(mode, args.threads, args.seconds, args.work_ms, queue)
        )
        for _ in range(args.processes)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=args.seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    overshoot = sorted(v for r in results for v in r["overshoot_us"])
    trips = sorted(v for r in results for v in r["trip_us"])

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {
        "mode": mode,
        "not set": "; ".join({r["why_not"] for r in results if r["why_not"]}) or "-",
        "cores busy": round(sum(r["cpu_per_wall"] for r in results), 2),
        "waits/s": round(sum(r["waits"] / r["wall"] for r in results), 1),
        "overshoot p50 us": round(pct(overshoot, 0.5), 1),
        "overshoot p99 us": round(pct(overshoot, 0.99), 1),
        "tiny round trip p50 us": round(statistics.median(trips), 1) if trips else None,
        "tiny round trip p99 us": round(pct(trips, 0.99), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["spin", "yield", "blocking"],
                        choices=["cuda", "auto", "spin", "yield", "blocking"])  # fmt: skip
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--work-ms", type=float, default=5.0)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda_wait measures waits for a GPU: no CUDA device here")
    print(environment())
    rows = [run(mode, args) for mode in args.modes]
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
