"""Does a CUDA green context confine SAM's encoder to its SMs? Its images per second in
each form on an ordinary stream and on the engine's encoder stream with
SERVE_ENCODER_SMS set (`StageWorkers`: a green context's own stream), one process, no MPS.

Why: `bench/mps_priority.py` (2026-11-28, H100) ran graphed encoders on green contexts'
streams of 112 and 88 of the 132 SMs and they kept their full speed (352 img/s against
353 unconfined), so the decoder found no SM free: the graphs had been captured on a side
stream of the primary context, and a graph's kernels keep their capture stream's SMs. A
first run of this script (H200, 66 SMs) had the graph captured on the green context's
stream at 263 img/s, confined, and the thread made current in the context (its
`set_context`) confined only eager kernels on that context's NULL stream (239 img/s;
compiled 403, and a stream made there 384-408: torch's stream pool belongs to the
primary context). The service's capture (`models.cuda_graphs.capturing`) now takes the
current stream. Forms: eager, compiled, `service_graph` (`warm_and_capture` with the
stream current, as warm-up captures), `side_graph` (captured on a primary-context side
stream, as before that change). A confined form slows in proportion to its SMs.

    python -m bench.green_confine --sms 66 --seconds 3
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any


def _rate(fn: Callable[[], object], stream: Any, batch: int, seconds: float) -> float:
    import torch

    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            fn()
            stream.synchronize()
            done += batch
    return done / (time.perf_counter() - started)


FORMS = ["eager", "compiled", "service_graph", "side_graph"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, nargs="+", default=[66])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--forms", nargs="+", default=FORMS, choices=FORMS)
    args = parser.parse_args()

    import torch

    from bench.mps_priority import _sam
    from models.cuda_graphs import warm_and_capture
    from models.optimize import compile_fn
    from server.engine.workers import StageWorkers

    model = _sam(args.batch)
    x = torch.randn(args.batch, 3, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    compiled = compile_fn(model.encode, "default", dynamic=False)
    rows: list[tuple[str, str, float]] = []

    def forms(stream: Any) -> dict[str, Callable[[], object]]:
        out: dict[str, Callable[[], object]] = {}
        if "eager" in args.forms:
            out["eager"] = lambda: model.encode(x)
        if "compiled" in args.forms:
            out["compiled"] = lambda: compiled(x)
        if "service_graph" in args.forms:  # the service's capture path, on `stream` current
            with torch.cuda.stream(stream):
                graph, _ = warm_and_capture(lambda: compiled(x), None)
            out["service_graph"] = graph.replay
        if "side_graph" in args.forms:  # captured on a side stream of the primary context
            graph, _ = warm_and_capture(lambda: compiled(x), None, priority=0)
            out["side_graph"] = graph.replay
        return out

    def measure(where: str, stream: Any) -> None:
        for form, fn in forms(stream).items():
            rows.append((where, form, _rate(fn, stream, args.batch, args.seconds)))
            print(rows[-1], flush=True)

    with torch.inference_mode():
        measure("all SMs, a plain stream", torch.cuda.Stream())
        for n in args.sms:  # the service's own green context and its encoder stream
            workers = StageWorkers(torch.device("cuda", 0), "per_stage", encoder_sms=n)
            measure(f"{n} SMs (the engine's encoder stream)", workers.streams["sam_encoder"])
            workers.shutdown()
    print("| where | form | img/s |\n|---|---|---|")
    for where, form, rate in rows:
        print(f"| {where} | {form} | {rate:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
