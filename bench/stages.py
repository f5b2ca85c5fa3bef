"""The SAM stages as the service's GPU worker runs them, without HTTP, on real photos.

Builds the engine exactly as `python -m server` does (same settings, same optimizations,
same warm-up), then calls the encoder and decoder stage functions directly:

- wall time per batch (what `serve_batch_duration_seconds` measures), split by a profiler
  table of the host ops and the device kernels, to find what a batch waits on;
- decoder-only latency on a cached embedding for 1, 5 and 10 clicks, one request at a time
  (the interactive-annotation path of issue 5, without the HTTP hop);
- on CUDA, how many host-device synchronisations each call makes, counted with
  `torch.cuda.set_sync_debug_mode("warn")` (column `syncs`). The encoder call should make
  none, so the worker prepares the next batch while the GPU runs this one; the decoder's
  come at its end, where the masks' runs are copied back.

    python -m bench.stages --images .benchdata/images --batch 16 --iters 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import warnings
from pathlib import Path

import torch

from bench.common import DEFAULT_IMAGES, environment, print_table
from server.domain import Prompt
from server.engine.services import Engine
from server.engine.stages import DecodeItem, EncodeItem
from server.imaging import DecodedImage, decode_image
from server.metrics import Metrics
from server.settings import Settings


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - started) * 1000)
    return out


def _count_syncs(fn) -> tuple[int | str, list[str]]:
    """Synchronising CUDA calls made by one `fn()` (warnings from the sync debug mode), and
    where each came from (`file:line` of the Python caller), so a count above zero names
    the line to fix."""
    if not torch.cuda.is_available():
        return "n/a (CPU)", []
    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), [f"{w.filename}:{w.lineno}" for w in syncs]


def _profile(name: str, fn, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        _sync()
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total"):
        if key == "self_device_time_total" and not torch.cuda.is_available():
            continue
        table = averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)
        print(f"--- {name}: top by {key}\n{table}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--clicks-iters", type=int, default=100)
    p.add_argument("--profile-rows", type=int, default=18)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    settings = Settings(enable_swin=False, max_batch_size=args.batch, batch_buckets=[1, args.batch])
    engine = Engine(settings, Metrics())
    asyncio.run(engine.load())
    assert engine.sam is not None
    stages = engine.sam.stages
    started = time.perf_counter()
    stages.warmup()
    print(f"warm-up {time.perf_counter() - started:.1f}s", flush=True)

    photos = sorted(args.images.glob("*.jpg"))

    def decode(path: Path) -> DecodedImage:  # as the service does: pinned memory on CUDA
        return decode_image(
            path.read_bytes(),
            max_pixels=40_000_000,
            max_bytes=50 << 20,
        )

    decoded = [decode(path) for path in photos]
    decode_ms = _timed(lambda: decode(photos[0]), 5)
    items = [EncodeItem(f"img-{k}", decoded[k % len(decoded)].pixels) for k in range(args.batch)]
    embeddings = stages.encode(items)
    boxes = [
        DecodeItem(
            e,
            (Prompt(box=(w * 0.25, h * 0.25, w * 0.6, h * 0.6)),),
            multimask=False,
        )
        for e in embeddings
        for h, w in [e.original_size]
    ]
    rows = []
    for name, fn in (
        (f"encode {args.batch} photos", lambda: stages.encode(items)),
        (f"decode {args.batch} boxes (+ masks, RLE runs)", lambda: stages.decode(boxes)),
    ):
        ms = _timed(fn, args.iters)
        syncs, sites = _count_syncs(fn)
        rows.append(
            {"call": name, "p50_ms": statistics.median(ms), "max_ms": max(ms), "syncs": syncs}
        )
        print(rows[-1], flush=True)
        for site in sites:
            print(f"  sync in {name!r} at {site}", flush=True)
    rows.append({"call": f"decode_image {photos[0].name}", "p50_ms": statistics.median(decode_ms)})
    entry = embeddings[0]
    h, w = entry.original_size
    for n in (1, 5, 10):
        points = tuple((w * (0.2 + 0.6 * k / n), h * (0.3 + 0.4 * (k % 2))) for k in range(n))
        click = DecodeItem(entry, (Prompt(points=points, labels=(1,) * n),), multimask=True)
        ms = _timed(lambda click=click: stages.decode([click]), args.clicks_iters)
        q = statistics.quantiles(ms, n=100)
        rows.append(
            {
                "call": f"clicks: {n} points, cached embedding",
                "p50_ms": q[49],
                "p99_ms": q[98],
                "max_ms": max(ms),
                "syncs": _count_syncs(lambda click=click: stages.decode([click]))[0],
            }
        )
        print(rows[-1], flush=True)
    _profile("encode", lambda: stages.encode(items), args.profile_rows)
    _profile("decode", lambda: stages.decode(boxes), args.profile_rows)
    print(
        f"\n{env['device']}, torch {env['torch']}, {env['date']}, photos {[p.name for p in photos]}"
    )
    print_table(rows, ["call", "p50_ms", "p99_ms", "max_ms", "syncs"])


if __name__ == "__main__":
    main()
