"""How much busy Python threads slow the GPU worker's stage calls, by GIL switch interval.

PyTorch's Python bindings release the GIL around every op, so the worker thread gives the
GIL away hundreds of times per batch. Each time another thread runs Python (JSON, multipart
parsing, RLE strings, the event loop), getting it back can take up to the switch interval
(5 ms by default). This script times the real SAM stage calls alone, then beside N threads
running pure Python, at several `sys.setswitchinterval` values. It runs on the CPU (tiny
model) or a GPU (any model).

    python -m bench.gil_contention --model vit_tiny --threads 6 --intervals 5 1 0.5 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

import torch

from bench.common import environment, print_table
from server.domain import Prompt
from server.engine.services import Engine
from server.engine.stages import DecodeItem, EncodeItem
from server.metrics import Metrics
from server.settings import Settings


def busy_python(stop: threading.Event) -> None:
    """What the service's other threads do between native calls: Python-level work."""
    payload = {"counts": "x" * 2000, "size": [480, 640], "score": 0.9}
    while not stop.is_set():
        json.loads(json.dumps([payload] * 20))


def timed(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - started) * 1000)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="vit_tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=6)
    p.add_argument("--intervals", nargs="+", type=float, default=[5, 1, 0.5, 0.2])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    env = environment()
    settings = Settings(sam_model=args.model, enable_swin=False, max_batch_size=args.batch,
                        batch_buckets=[1, args.batch], warmup=True)  # fmt: skip
    engine = Engine(settings, Metrics())
    asyncio.run(engine.load())
    assert engine.sam is not None
    stages = engine.sam.stages
    stages.warmup()
    g = torch.Generator().manual_seed(0)
    side = stages.config.image_size
    pixels = [
        torch.randint(0, 256, (side * 3 // 4, side, 3), dtype=torch.uint8, generator=g)
        for _ in range(args.batch)
    ]
    items = [EncodeItem(f"img-{k}", px) for k, px in enumerate(pixels)]
    entries = stages.encode(items)
    boxes = [DecodeItem(e, (Prompt(box=(10.0, 10.0, side / 2, side / 3)),), False) for e in entries]
    calls = {"encode": lambda: stages.encode(items), "decode": lambda: stages.decode(boxes)}
    default = sys.getswitchinterval()
    rows = [{"threads": 0, "interval_ms": default * 1000,
             **{f"{k}_ms": timed(fn, args.iters) for k, fn in calls.items()}}]  # fmt: skip
    for interval in args.intervals:
        sys.setswitchinterval(interval / 1000)
        stop = threading.Event()
        workers = [threading.Thread(target=busy_python, args=(stop,)) for _ in range(args.threads)]
        for w in workers:
            w.start()
        try:
            row = {"threads": args.threads, "interval_ms": interval}
            row.update({f"{k}_ms": timed(fn, args.iters) for k, fn in calls.items()})
        finally:
            stop.set()
            for w in workers:
                w.join()
        rows.append(row)
        print(row, flush=True)
    sys.setswitchinterval(default)
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, {args.model}, "
          f"batch {args.batch}, {torch.get_num_threads()} intra-op threads")  # fmt: skip
    print_table(rows, ["threads", "interval_ms", "encode_ms", "decode_ms"])


if __name__ == "__main__":
    main()
