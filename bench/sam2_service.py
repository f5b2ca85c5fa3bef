"""SAM 2.1 as the service runs it, without HTTP, on real photos: the engine's `Sam2Stages`
built from the settings exactly as `python -m server` builds them (bf16, torch.compile and
one CUDA graph per encoder bucket on CUDA; fp32 eager on the CPU).

- warm-up seconds (every encoder bucket compiled and graphed, the decoder's forms compiled);
- encoder img/s per warmed bucket (photos of mixed sizes, the square resize included);
- a click's decoder latency on a cached embedding (one request, masks and RLE runs);
- fidelity of the served variant against fp32 eager `Sam2` on the same weights, measured
  as the start-up check measures it (`Sam2Stages.fidelity_outputs` against
  `models.fidelity.eager_sam2_runner`): embedding relative error, and per photo five
  prompts' four masks each (single-mask, SAM 2's stability fallback included, and the
  three multimask ones): mask IoU and score difference;
- with `--everything N`: segment everything on cached embeddings, ms per photo, through the
  engine's `EverythingRunner` as a request runs it (steps on the GPU worker, under the
  serving stance), and the generator called directly (no worker, no stance).

    SERVE_SAM_MODEL=sam2.1_hiera_large python -m bench.sam2_service --batch 8
    SERVE_DEVICE=cpu SERVE_SAM_MODEL=sam2_test_tiny python -m bench.sam2_service --batch 2 --iters 2

Weights are SERVE_SAM_CHECKPOINT's, else seeded random ones (SERVE_SEED).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import DEFAULT_IMAGES, cuda_time_ms, environment, load_photos, print_table
from models.fidelity import compare_sam, eager_sam2_runner
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.automatic import Sam2AutomaticMaskGenerator
from server.domain import Prompt
from server.engine.cache import ImageEmbedding
from server.engine.sam2_stages import Sam2Stages
from server.engine.services import Engine
from server.engine.stages import DecodeItem, EncodeItem
from server.metrics import Metrics
from server.settings import Settings


def everything(
    engine: Engine, photos: list[torch.Tensor], points_per_batch: int
) -> list[dict[str, object]]:
    """Segment everything's ms per photo two ways (module docstring), median of three runs
    after one warm-up run per photo."""
    assert engine.sam is not None
    stages, runner = engine.sam.stages, engine.sam.everything
    assert isinstance(stages, Sam2Stages)
    fields: dict[str, float | int] = {"points_per_batch": points_per_batch}
    entries = [stages.encode([EncodeItem(f"everything-{k}", p)])[0] for k, p in enumerate(photos)]

    def served(entry: ImageEmbedding) -> int:
        masks = asyncio.run(runner.run(runner.generator(fields), entry, None, "rle", None))
        return len(masks.scores)

    def direct(entry: ImageEmbedding) -> int:
        generator = runner.generator(fields)
        assert isinstance(generator, Sam2AutomaticMaskGenerator)
        features = runner.factory.features(entry)
        with torch.inference_mode():
            per_crop = []
            for job in generator.plan(entry.original_size):
                emb = generator.embedding_for(job, features)
                per_crop.append(
                    [generator.decode_chunk(emb, job, c) for c in range(job.num_chunks)]
                )
            return len(generator.finish(per_crop, entry.original_size).scores)

    rows: list[dict[str, object]] = []
    for name, run in (("as served", served), ("generator called directly", direct)):
        times, kept = [], []
        for entry in entries:
            run(entry)  # warm-up
            one = []
            for _ in range(3):
                started = time.perf_counter()
                kept.append(run(entry))
                one.append((time.perf_counter() - started) * 1000)
            times.append(statistics.median(one))
        rows.append({"call": f"everything, {name}", "ms": statistics.median(times),
                     "masks": statistics.mean(kept)})  # fmt: skip
        print(rows[-1], [round(t, 1) for t in times], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--batch", type=int, default=8, help="largest encoder bucket")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--clicks-iters", type=int, default=100)
    p.add_argument(
        "--everything",
        type=int,
        default=0,
        metavar="PHOTOS",
        help="time segment everything on this many photos (0: not)",
    )
    p.add_argument("--points-per-batch", type=int, default=64, help="for --everything")
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    buckets = sorted({1, 2, 4, args.batch} - {b for b in (2, 4) if b > args.batch})
    settings = Settings(
        enable_swin=False, max_batch_size=args.batch, batch_buckets=buckets,
        decoder_max_batch_prompts=64,
    )  # fmt: skip
    if settings.sam_model not in SAM2_CONFIGS:
        raise SystemExit(f"SERVE_SAM_MODEL={settings.sam_model!r} is no SAM 2 model")
    engine = Engine(settings, Metrics())
    asyncio.run(engine.load())
    assert engine.sam is not None and isinstance(engine.sam.stages, Sam2Stages)
    stages = engine.sam.stages
    # the engine's own warm-up: it also sets the no-recompile stance that served calls run
    # under (`stages.warmup()` alone did not, and hid the eager segment everything)
    warmup_s = asyncio.run(engine.warmup())
    print(f"{engine.sam.info}: warm-up {warmup_s:.1f}s", flush=True)
    photos = load_photos(args.images)

    rows: list[dict[str, object]] = []
    for bucket in stages.encoder_buckets:
        items = [EncodeItem(f"img-{k}", photos[k % len(photos)]) for k in range(bucket)]
        ms = cuda_time_ms(partial(stages.encode, items), args.iters)
        rows.append({"call": f"encode {bucket} photos", "ms": ms, "img_per_s": bucket * 1000 / ms})
        print(rows[-1], flush=True)
    (entry,) = stages.encode([EncodeItem("click", photos[0])])
    h, w = entry.original_size
    click = DecodeItem(entry, (Prompt(points=((w / 2, h / 2),), labels=(1,)),), multimask=True)
    ms = cuda_time_ms(lambda: stages.decode([click]), args.clicks_iters)
    rows.append({"call": "a click on a cached embedding (3 masks)", "ms": ms})
    if args.everything:
        rows += everything(engine, photos[: args.everything], args.points_per_batch)

    s = engine.settings
    reference = load_sam2(SAM2_CONFIGS[s.sam_model], s.sam_checkpoint, seed=s.seed)
    runner = eager_sam2_runner(reference.to(engine.device), engine.device)
    measures = compare_sam(runner, stages.fidelity_outputs, photos).measures()
    info = engine.sam.info
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, {info.name} {info.precision} "
          f"compile {info.compile_mode} graphs {info.cuda_graphs}, warm-up {warmup_s:.1f}s, "
          f"{len(photos)} photos")  # fmt: skip
    print_table(rows, ["call", "ms", "img_per_s", "masks"])
    print_table([measures], list(measures))


if __name__ == "__main__":
    main()
