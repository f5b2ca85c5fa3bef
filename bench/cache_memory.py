"""GPU memory the engine reserves while its embedding cache fills, with and without the
cache's own pool (`server.engine.gpu_memory.EntryPool`).

Under segment load on an H100 the engine reserved 52 to 81 GB for 4 to 8 GB allocated
(docs/BENCHMARKS.md, issue 19). This replays that load without HTTP: the engine built as
`python -m server` builds it (README defaults, SAM only), photos decoded as the service
decodes SAM's JPEGs (nvJPEG on the GPU when it works, else libjpeg-turbo into host memory),
encoded in batches on the encoder's worker thread and stream, every embedding put into
the cache under an id of its own, as fresh photos are. After every few batches it reads
the allocator: allocated, reserved, and what the cache's pool holds. Variants, each from
an emptied allocator in the same process (one compile):

- `stream`: embeddings cloned where the batch ran, as before the pool;
- `pool`: as served now, embeddings in the pool of what outlives a batch.

    python -m bench.cache_memory --images .benchdata/images --batches 300
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import DEFAULT_IMAGES, environment, print_table, write_json
from server.engine.cache import EmbeddingCache
from server.engine.gpu_memory import EntryPool
from server.engine.jpeg import host_decoder, nvjpeg_decoder
from server.engine.services import Engine
from server.engine.stages import EncodeItem, SamStages
from server.http.jpeg_pass import engine_decodable
from server.metrics import Metrics
from server.settings import Settings

GB = 1e9
LIMITS = {"max_pixels": 40_000_000, "max_bytes": 50 << 20}


def _decoder(device: torch.device) -> tuple[str, Callable[[Sequence[torch.Tensor]], list]]:
    """nvJPEG as the engine decodes SAM's files, where it works; else the host's."""
    if device.type == "cuda":
        try:
            decode = nvjpeg_decoder(device)
            return "nvjpeg", decode
        except ImportError:
            pass
    return "host", host_decoder


def _memory(pool: EntryPool) -> dict[str, float]:
    if not torch.cuda.is_available():
        return {"allocated_gb": 0.0, "reserved_gb": 0.0, "pool_gb": 0.0}
    return {
        "allocated_gb": round(torch.cuda.memory_allocated() / GB, 3),
        "reserved_gb": round(torch.cuda.memory_reserved() / GB, 3),
        "pool_gb": round(pool.reserved_bytes() / GB, 3),
    }


def _fill(
    engine: Engine,
    stages: SamStages,
    pool: EntryPool,
    files: list[torch.Tensor],
    decode: Callable[[Sequence[torch.Tensor]], list],
    batches: int,
    batch: int,
    every: int,
    variant: str,
) -> list[dict[str, object]]:
    """Encode `batches` batches of photos, each image cached under a new id."""
    cache = EmbeddingCache(engine.settings.embedding_cache_bytes, device=engine.device, pool=pool)
    stages.entry_pool = pool
    encoder = engine.workers["sam_encoder"]

    def encode(items: list[EncodeItem]) -> list:
        return engine.workers.handed_over(stages.encode(items))

    rows: list[dict[str, object]] = []
    started = time.perf_counter()
    peak_reserved = 0.0
    for b in range(batches):
        chosen = [files[(b * batch + k) % len(files)] for k in range(batch)]
        pixels = decode(chosen)
        items = [EncodeItem(f"{variant}-{b}-{k}", p) for k, p in enumerate(pixels)]
        for entry in encoder.submit(encode, items).result():
            cache.put(entry)
        del pixels, items
        if (b + 1) % every == 0 or b + 1 == batches:
            row: dict[str, object] = {
                "variant": variant,
                "batches": b + 1,
                "cached": len(cache),
                "cache_gb": round(cache.bytes_used / GB, 3),
                **_memory(pool),
                "s": round(time.perf_counter() - started, 1),
            }
            peak_reserved = max(peak_reserved, float(row["reserved_gb"]))  # type: ignore[arg-type]
            row["peak_reserved_gb"] = peak_reserved
            rows.append(row)
            print(row, flush=True)
    del cache
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="images per encoder batch")
    p.add_argument("--every", type=int, default=25, help="batches between readings")
    p.add_argument("--variants", nargs="+", default=["stream", "pool"], choices=["stream", "pool"])
    p.add_argument("--sam-model", default="vit_b")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    engine = Engine(Settings(enable_swin=False, sam_model=args.sam_model), Metrics())
    asyncio.run(engine.load())
    assert engine.sam is not None
    stages = engine.sam.stages
    started = time.perf_counter()
    engine.workers["sam_encoder"].submit(stages.warmup).result()
    engine.workers.synchronize()
    print(f"warm-up {time.perf_counter() - started:.1f}s", flush=True)
    how, decode = _decoder(engine.device)
    files = [
        torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        for path in sorted(args.images.glob("*.jpg"))
    ]
    if how == "nvjpeg":  # the files a frontend passes; progressive ones it decodes itself
        files = [f for f in files if engine_decodable(bytes(f.numpy()), **LIMITS) is not None]
    print(f"{len(files)} photos decoded by {how}", flush=True)
    summary = []
    for variant in args.variants:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        before = _memory(engine.entry_pool)
        print(f"== {variant}: before {before}", flush=True)
        pool = engine.entry_pool if variant == "pool" else EntryPool(torch.device("cpu"))
        rows = _fill(
            engine, stages, pool, files, decode, args.batches, args.batch, args.every, variant
        )
        last = rows[-1]
        summary.append(
            {
                "variant": variant,
                "images": args.batches * args.batch,
                "cached": last["cached"],
                "cache_gb": last["cache_gb"],
                "allocated_gb": last["allocated_gb"],
                "reserved_gb": last["reserved_gb"],
                "peak_reserved_gb": last["peak_reserved_gb"],
                "pool_gb": last["pool_gb"],
                "reserved_before_gb": before["reserved_gb"],
            }
        )
    write_json(args.json, {"environment": env, "decoder": how, "rows": summary})
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, decoder {how}")
    print_table(
        summary,
        ["variant", "images", "cached", "cache_gb", "allocated_gb", "reserved_gb",
         "peak_reserved_gb", "pool_gb", "reserved_before_gb"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
