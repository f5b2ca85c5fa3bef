"""Whether a click's decoder batch passes other processes' encoders on a shared GPU, and why.

Why: in the service's mix (six engines on one GPU under MPS) a decoder batch's GPU span
grew from 1.8 ms alone to 7-12 ms (docs/BENCHMARKS.md, issue 19). This measured what
MPS's client priority (`CUDA_MPS_CLIENT_PRIORITY`, the engines split by stage) would buy,
and found the cause elsewhere: a CUDA graph's kernels run at the priority of the stream
it was captured on, whatever stream replays it, and the engines captured every graph on
a default-priority stream (169 ms beside five encoder processes, 7.1 ms captured at high
priority; H100, 2026-11-27).

The parent is the probe, as a decoder engine would be: SAM ViT-B's prompt encoder and mask
decoder in bf16, a batch of `--prompts` one-point clicks on as many embeddings, as a CUDA
graph captured on a stream of the lowest priority, one captured on the highest, eager, and
a graph of as many tiny kernels as the decoder launches (added 2026-11-28, not yet run: does
a batch beside the encoders pay per kernel?); each replayed every `--period-ms` on a
stream of the highest priority, its GPU span (events on that stream) and launch-to-done
wall time recorded. Loads are other processes
(MPS clients started with or without `CUDA_MPS_CLIENT_PRIORITY`), each running the
compiled, graphed encoder on batches of `--batch` back to back on a stream of default
priority, as an engine's encoder stage does; they report their images per second.
`thread` runs one such load in the probe's own process; `workers` captures the decoder
through the service's own `StageWorkers` as warm-up does, beside a graphed load on the
encoder's thread. `green` and `green_thread` run the loads in CUDA green contexts of
`--load-sms` SMs, so that the rest of the GPU's SMs are always free for the probe (what
priority alone cannot give: 6-7 ms a batch beside the encoders against 2.0 alone). A
private MPS daemon is started for the run (as `server.mps` does) unless
CUDA_MPS_PIPE_DIRECTORY is set.

    python -m bench.mps_priority --loads 1 5 --seconds 8
    python -m bench.mps_priority --configs alone green green_thread --loads 5 --load-sms 112
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
BELOW_NORMAL = "1"  # the MPS guide's values: 0 NORMAL (the default), 1 BELOW_NORMAL


def _sam(batch: int | None = None) -> Any:
    import torch

    from models.optimize import OptimizeOptions, prepare_sam_encoder
    from models.sam import SAM_CONFIGS, load_sam

    model = load_sam(SAM_CONFIGS["vit_b"], None).to("cuda", torch.bfloat16)
    if batch is not None:  # the encoder as the service compiles it on CUDA
        opts = OptimizeOptions(
            precision="bf16", attention="triton", window_attention="triton",
            compile_mode="default", cuda_graphs=True, gelu_epilogue=True,
        )  # fmt: skip
        prepare_sam_encoder(model.image_encoder, opts, torch.device("cuda"))
    return model


def _green_stream(sms: int) -> Any:
    """The engine's encoder stream with SERVE_ENCODER_SMS=`sms` (`StageWorkers`: a stream
    of a CUDA green context of that many SMs). Why: priority orders the blocks waiting
    for an SM but never frees one, so a click's kernels still wait for encoder blocks to
    end (6-7 ms a decoder batch beside the encoders against 2.0 alone). SMs the encoders
    can never take are free the moment a decoder kernel arrives. A graph keeps to the SMs
    of the stream it was captured on: captured on a side stream of the primary context
    and replayed here it used every SM (H100, 2026-11-28); the service's capture now
    takes the current stream, this one."""
    import torch

    from server.engine.workers import StageWorkers

    workers = StageWorkers(torch.device("cuda", 0), "per_stage", encoder_sms=sms)
    _kept.append(workers)  # its green context must outlive every kernel sent to it
    return workers.streams["sam_encoder"]


_kept: list[Any] = []


def _encoder_loop(
    batch: int,
    ready: Callable[[], None],
    counting: threading.Event,
    stop: threading.Event,
    sms: int | None = None,
    graphs: bool = True,
) -> tuple[int, float]:
    """Encoder batches back to back until `stop`; the images done and the seconds taken
    while `counting` was set (the probe's window). `sms`: compiled, captured and run in a
    green context of that many SMs."""
    import torch

    from models.optimize import GraphedBuckets, compile_fn

    stream = _green_stream(sms) if sms else torch.cuda.Stream(priority=0)
    model = _sam(batch)
    compiled = compile_fn(model.encode, "default", dynamic=False)
    x = torch.randn(batch, 3, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    images, started = 0, 0.0
    with torch.inference_mode(), torch.cuda.stream(stream):
        fn = GraphedBuckets(compiled, enabled=graphs)
        fn.capture(x)  # on `stream`, current (`models.cuda_graphs.capturing`): its SMs too
        stream.synchronize()
        ready()
        while not stop.is_set():
            fn(x)
            stream.synchronize()  # an engine hands each batch over before the next
            if counting.is_set():
                if not images:
                    started = time.perf_counter()
                images += batch
    return images, time.perf_counter() - started


def _load_main(args: argparse.Namespace) -> None:
    """A load process: "ready" once warm; counts from stdin's first line, stops at EOF."""
    counting, stop = threading.Event(), threading.Event()

    def listen() -> None:
        sys.stdin.readline()
        counting.set()
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=listen, daemon=True).start()

    def announce() -> None:
        print("ready", flush=True)

    images, seconds = _encoder_loop(
        args.batch, announce, counting, stop, args.load_sms, args.load_graphs == "on"
    )
    print(json.dumps({"images": images, "seconds": seconds}), flush=True)


class Probe:
    """The decoder batch on the highest-priority stream: a CUDA graph's replay (as the
    service runs it) and the same call eager (the kernels launched one by one)."""

    def __init__(self, prompts: int) -> None:
        import torch

        from models.cuda_graphs import warm_and_capture
        from models.sam import PromptSet, pack_prompts

        self.torch = torch
        model = _sam()
        emb = torch.randn(prompts, 256, 64, 64, device="cuda", dtype=torch.bfloat16)
        sets = [PromptSet(points=[[100.0 + 50 * i, 300.0]], labels=[1]) for i in range(prompts)]
        batch = pack_prompts(sets, list(range(prompts)), "cuda", mask_size=256)
        low, high = torch.cuda.Stream.priority_range()
        self.stream = torch.cuda.Stream(priority=high)
        self.priority_range = (low, high)
        with torch.inference_mode():  # captured on a side stream of the lowest priority ...
            graph, _ = warm_and_capture(lambda: model.decode(emb, batch), None, priority=low)
            # ... and of the highest (the probe's stream), its kernels replayed the same way
            graph_hi, _ = warm_and_capture(lambda: model.decode(emb, batch), None, priority=high)

        def eager() -> None:
            with torch.inference_mode():
                model.decode(emb, batch)

        self.eager = eager
        self.kernels = _kernel_count(eager)
        # as many launches as the decoder's, each next to nothing: if beside the loads this
        # chain's span grows as the decoder's does, a batch pays per kernel (each waits for
        # a block of the encoders to leave an SM), not for its work
        scratch = torch.zeros(256, device="cuda")
        chain, _ = warm_and_capture(
            lambda: [scratch.add_(1.0) for _ in range(self.kernels)], None, priority=high
        )

        self.forms: dict[str, Callable[[], object]] = {
            "graph": graph.replay, "graph captured at high priority": graph_hi.replay,
            "eager": eager,
            f"{self.kernels} tiny kernels, graph at high priority": chain.replay,
        }  # fmt: skip

    def measure(self, seconds: float, period_ms: float) -> list[dict[str, Any]]:
        """Each form for `seconds`, one batch a period (open loop; a late one goes at once)."""
        return [{"probe": form, **self.time_form(fn, seconds, period_ms)}
                for form, fn in self.forms.items()]  # fmt: skip

    def time_form(
        self, fn: Callable[[], object], seconds: float, period_ms: float
    ) -> dict[str, float]:
        """One form's GPU spans and wall times, replayed on the probe's stream."""
        torch = self.torch
        gpu, wall = [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        deadline = time.perf_counter() + seconds
        next_at = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while next_at < deadline:
                time.sleep(max(0.0, next_at - time.perf_counter()))
                launched = time.perf_counter()
                start.record(self.stream)
                fn()
                end.record(self.stream)
                end.synchronize()
                wall.append((time.perf_counter() - launched) * 1e3)
                gpu.append(start.elapsed_time(end))
                next_at += period_ms / 1e3
        return {**_spread("gpu", gpu), **_spread("wall", wall), "batches": len(gpu)}


def _kernel_count(fn: Callable[[], object]) -> int:
    """The GPU kernels one call of `fn` launches (the profiler's kernel records; memcpys and
    memsets are not kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]  # fmt: skip
    return max(1, len(kernels))


def _spread(name: str, values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100)
    return {f"{name}_p50": cuts[49], f"{name}_p90": cuts[89], f"{name}_p99": cuts[98],
            f"{name}_max": max(values)}  # fmt: skip


def _start_loads(
    n: int, priority: str | None, args: argparse.Namespace, sms: int | None = None
) -> list[subprocess.Popen[str]]:
    env = {k: v for k, v in os.environ.items() if k != PRIORITY_ENV}
    if priority is not None:
        env[PRIORITY_ENV] = priority
    cmd = [sys.executable, "-m", "bench.mps_priority", "--role", "load", "--batch", str(args.batch)]
    if sms:
        cmd += ["--load-sms", str(sms)]
    cmd += ["--load-graphs", args.load_graphs]
    procs = [
        subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    for p in procs:  # each says "ready" once compiled and captured
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"a load process did not start (exit {p.wait()}): {line!r}")
    return procs


def _tell(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()


def _finish_loads(procs: list[subprocess.Popen[str]]) -> float:
    """Stop the loads; their images per second, summed, over the probe's window."""
    _tell(procs)
    total = 0.0
    for p in procs:
        assert p.stdout is not None
        out = json.loads(p.stdout.read().strip().splitlines()[-1])
        p.wait()
        total += out["images"] / out["seconds"]
    return total


def _daemon() -> Path | None:
    """A private MPS daemon, its pipes in this process's environment before torch first
    touches CUDA (the probe must be an MPS client too); its folder, None if one is set up."""
    if "CUDA_MPS_PIPE_DIRECTORY" in os.environ:
        return None
    folder = Path(tempfile.mkdtemp(prefix="mps-priority-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipes"),
           "CUDA_MPS_LOG_DIRECTORY": str(folder / "logs")}  # fmt: skip
    for path in env.values():
        Path(path).mkdir()
    os.environ.update(env)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    return folder


def _control(command: str) -> str:
    done = subprocess.run(["nvidia-cuda-mps-control"], input=command + "\n", text=True,
                          capture_output=True, check=False)  # fmt: skip
    return (done.stdout + done.stderr).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["probe", "load"], default="probe")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--batch", type=int, default=8, help="encoder batch of each load")
    parser.add_argument("--prompts", type=int, default=8, help="clicks in a decoder batch")
    parser.add_argument("--seconds", type=float, default=8.0, help="probe time per config")
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument(
        "--configs", nargs="+", default=["alone", "normal", "below_normal", "workers", "thread"],
        choices=["alone", "normal", "below_normal", "workers", "thread", "green", "green_thread"],
    )  # fmt: skip
    parser.add_argument(
        "--load-sms", type=int, default=None,
        help="SMs of the green contexts of configs green, green_thread (H100: 132; 8 a step)",
    )  # fmt: skip
    parser.add_argument(
        "--load-graphs", choices=["on", "off"], default="on",
        help="off: the loads' compiled encoder launched kernel by kernel (no CUDA graph)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if {"green", "green_thread"} & set(args.configs) and not args.load_sms:
        parser.error("configs green and green_thread need --load-sms")
    if args.role == "load":
        _load_main(args)
        return
    folder = _daemon()
    try:
        _run(args)
    finally:
        if folder is not None:
            print("MPS daemon:", _control("quit") or "quit", flush=True)
            shutil.rmtree(folder, ignore_errors=True)


def _workers_rows(probe: Probe, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The service's own path: the decoder graph captured on the encoder's thread as the
    engine's warm-up does, inside `StageWorkers.on_stream("sam_decoder")` (now) or not
    (before), replayed beside the graphed encoder running back to back on the encoder's
    thread (on a stream of the encoder stage's priority, 0, as `_encoder_loop` makes).

    (Its first form put sixteen 8192^2 products there as the load: the decoder took 36 ms
    a batch either way, H100, 2026-11-28. Each product is a few long kernels holding every
    SM, and priority frees no SM, so that load could not show what priority does.)"""
    import torch

    from models.cuda_graphs import warm_and_capture
    from server.engine.workers import StageWorkers

    workers = StageWorkers(torch.device("cuda"))
    encoder = workers["sam_encoder"]

    def capture(on_stream: bool) -> Any:
        with (
            torch.inference_mode(),
            workers.on_stream("sam_decoder") if on_stream else nullcontext(),
        ):
            return warm_and_capture(probe.eager, None)[0]

    graphs = {
        "warmed on the decoder's stream (now)": encoder.submit(capture, True).result(),
        "warmed on the encoder's (before)": encoder.submit(capture, False).result(),
    }
    ready, counting, stop = threading.Event(), threading.Event(), threading.Event()

    spinning = encoder.submit(_encoder_loop, args.batch, ready.set, counting, stop)
    try:
        if not ready.wait(timeout=600):
            raise SystemExit("the encoder load did not start")
        counting.set()
        rows = [{"config": "StageWorkers, the graphed encoder on the encoder's thread",
                 "probe": label, **probe.time_form(graph.replay, args.seconds, args.period_ms)}
                for label, graph in graphs.items()]  # fmt: skip
    finally:
        stop.set()
        images, seconds = spinning.result()
        workers.shutdown()
    for row in rows:
        row["load_img_s"] = images / seconds
        print(row, flush=True)
    return rows


def _thread_rows(
    probe: Probe, args: argparse.Namespace, sms: int | None
) -> tuple[list[dict[str, Any]], float]:
    """The probe beside one graphed encoder on a thread of this process (in a green
    context of `sms` SMs if given); the probe's rows and the load's images per second."""
    ready, counting, stop = threading.Event(), threading.Event(), threading.Event()
    result: list[tuple[int, float]] = []
    thread = threading.Thread(
        target=lambda: result.append(
            _encoder_loop(args.batch, ready.set, counting, stop, sms, args.load_graphs == "on")
        )
    )
    thread.start()
    if not ready.wait(timeout=600):
        stop.set()
        raise SystemExit("the load thread did not start")
    counting.set()
    try:
        measured = probe.measure(args.seconds, args.period_ms)
    finally:
        stop.set()
        thread.join()
    return measured, result[0][0] / result[0][1]


def _run(args: argparse.Namespace) -> None:
    import torch

    from bench.common import environment, print_table, write_json

    probe = Probe(args.prompts)
    print("MPS servers:", _control("get_server_list") or "none", "; stream priorities",
          probe.priority_range, "; kernels in a decoder batch:", probe.kernels,
          flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []

    def record(config: str, measured: list[dict[str, Any]], load_img_s: float | None) -> None:
        for row in measured:
            rows.append({"config": config, **row, "load_img_s": load_img_s})
            print(rows[-1], flush=True)

    if "alone" in args.configs:
        record("alone", probe.measure(args.seconds, args.period_ms), None)
    for n in args.loads:
        for label, priority in (("NORMAL", None), ("BELOW_NORMAL", BELOW_NORMAL)):
            if label.lower() not in args.configs:
                continue
            procs = _start_loads(n, priority, args)
            _tell(procs)  # count from here
            measured = probe.measure(args.seconds, args.period_ms)
            record(f"{n} load processes, {label}", measured, _finish_loads(procs))
    if "green" in args.configs:
        for n in args.loads:
            procs = _start_loads(n, None, args, args.load_sms)
            _tell(procs)
            measured = probe.measure(args.seconds, args.period_ms)
            label = f"{n} load processes, each in a green context of {args.load_sms} SMs"
            record(label, measured, _finish_loads(procs))
    if "workers" in args.configs:
        rows.extend(_workers_rows(probe, args))
    if "thread" in args.configs:
        record("1 load thread, this process", *_thread_rows(probe, args, None))
    if "green_thread" in args.configs:
        label = f"1 load thread, this process, in a green context of {args.load_sms} SMs"
        record(label, *_thread_rows(probe, args, args.load_sms))
    torch.cuda.synchronize()
    cols = ["config", "probe", "gpu_p50", "gpu_p90", "gpu_p99", "gpu_max", "wall_p50", "wall_p99",
            "batches", "load_img_s"]  # fmt: skip
    print_table(rows, cols)
    write_json(args.json, {"environment": environment(), "args": vars(args) | {"json": None},
                           "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
