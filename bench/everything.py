"""Segment everything per image: ours (device-resident, step-wise) against Meta's
`SamAutomaticMaskGenerator`, same random weights, same real photos, one process.

Latency is the whole pipeline per photo (encoder included, masks on the host at the end:
RLE for ours, Meta's own output for theirs), p50/p99 over the photos and repeats; peak
memory is `torch.cuda.max_memory_allocated` over each configuration's runs.

    python -m bench.everything --images ../shared/data/images --points 32 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    DEFAULT_IMAGES,
    empty_cache,
    environment,
    load_photos,
    peak_gib,
    print_table,
    reset_peak,
    write_json,
)
from models.sam import SAM_CONFIGS, load_sam
from models.sam.automatic import AutomaticMaskGenerator, AutomaticMaskSettings
from server.engine.runs import mask_runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ours(
    model, photos, points: int, repeats: int, iou_thresh: float, stability: float
) -> tuple[list[float], list[int]]:
    generator = AutomaticMaskGenerator(
        model,
        AutomaticMaskSettings(
            points_per_side=points, pred_iou_thresh=iou_thresh, stability_score_thresh=stability
        ),
    )
    times, counts = [], []
    for _ in range(repeats):
        for photo in photos:
            sync()
            started = time.perf_counter()
            with torch.inference_mode():
                out = generator.generate(photo.to(DEVICE))
                runs = mask_runs([out.masks])[0]  # what the service sends: RLE, host side
            times.append(time.perf_counter() - started)
            counts.append(len(runs))
    return times, counts


def reference_model(config_name: str, ours) -> Any:
    """Meta's SAM with our weights (the same random, synthetic or real ones)."""
    from segment_anything import sam_model_registry

    ref = sam_model_registry[config_name]()
    ref.load_state_dict(ours.state_dict(), strict=False)  # pixel_mean/std are buffers
    return ref.to(DEVICE).eval()


def time_meta(
    ref, photos, points: int, repeats: int, iou_thresh: float, stability: float
) -> tuple[list[float], list[int]]:
    from segment_anything import SamAutomaticMaskGenerator

    generator = SamAutomaticMaskGenerator(
        ref,
        points_per_side=points,
        output_mode="coco_rle",
        pred_iou_thresh=iou_thresh,
        stability_score_thresh=stability,
    )
    times, counts = [], []
    for _ in range(repeats):
        for photo in photos:
            image = photo.numpy()
            sync()
            started = time.perf_counter()
            masks = generator.generate(image)
            times.append(time.perf_counter() - started)
            counts.append(len(masks))
    return times, counts


def summary(name: str, points: int, times: list[float], counts: list[int]) -> dict[str, Any]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "pipeline": name,
        "points_per_side": points,
        "runs": len(times),
        "p50_ms": statistics.median(times) * 1000,
        "p99_ms": p99 * 1000,
        "mean_masks": float(np.mean(counts)),
        "peak_gib": peak_gib(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="vit_b", choices=list(SAM_CONFIGS))
    p.add_argument("--points", nargs="+", type=int, default=[32, 64])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--no-meta", action="store_true")
    p.add_argument(
        "--sam-checkpoint",
        type=Path,
        default=None,
        help="e.g. synthetic weights (python -m models.weights synthesize): masks of shapes",
    )
    # Random weights predict low IoUs: at Meta's defaults (0.88, 0.95) no mask survives and
    # NMS and RLE never run. Lower thresholds keep masks, so the whole pipeline is timed.
    p.add_argument("--pred-iou-thresh", type=float, default=0.88)
    p.add_argument("--stability-thresh", type=float, default=0.95)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    photos = load_photos(args.images)
    config = SAM_CONFIGS[args.model]
    ours_fp32 = load_sam(config, args.sam_checkpoint, seed=0).to(DEVICE)
    ours_bf16 = load_sam(config, args.sam_checkpoint, seed=0).to(DEVICE, torch.bfloat16)
    ref = None if args.no_meta else reference_model(args.model, ours_fp32)
    models = {"ours fp32": ours_fp32, "ours bf16": ours_bf16}
    names = [*models, *([] if ref is None else ["Meta fp32"])]
    rows = []
    for points in args.points:
        for name in names:

            def run(
                shots: list[torch.Tensor], repeats: int, name: str = name, points: int = points
            ) -> tuple:
                thresholds = (args.pred_iou_thresh, args.stability_thresh)
                if name in models:
                    return time_ours(models[name], shots, points, repeats, *thresholds)
                return time_meta(ref, shots, points, repeats, *thresholds)

            run(photos[:1], 1)  # warm-up on one photo
            empty_cache()
            reset_peak()
            rows.append(summary(name, points, *run(photos, args.repeats)))
            print(rows[-1], flush=True)
    write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    print(
        f"\n{env['device']}, torch {env['torch']}, {env['date']}, {args.model}, "
        f"{len(photos)} photos x {args.repeats}, pred_iou_thresh {args.pred_iou_thresh}, "
        f"stability_score_thresh {args.stability_thresh}"
    )
    print_table(
        rows, ["pipeline", "points_per_side", "runs", "p50_ms", "p99_ms", "mean_masks", "peak_gib"]
    )


if __name__ == "__main__":
    main()
