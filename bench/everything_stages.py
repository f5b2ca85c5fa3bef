"""Where segment everything's time goes, stage by stage (issue 24; a GPU script, a smoke
test on the CPU).

`bench.sam2` times the whole generator per photo: on the H100 ours took 0.81 s fp32 and
0.69 s bf16 per photo with synthetic hiera-large weights (379 masks kept), against the
issue's 0.326 s at mIoU 0.994. Both dtypes alike says the time is not the model's
arithmetic; this script says whose it is. Each hook of the generator (`_encode`, the
decoder call `_decode`, `_measure`: upscaling, stability and boxes of the candidates that
passed the IoU filter, `_paint`, the box NMS) is wrapped by a timer that synchronises the
device before and after, so each row is that step's own wall time; "filter" is the rest
of `decode_chunk` (the IoU and stability filters and their host syncs), "finish other"
the rest of `finish`, and "to host" the final masks' copy. The synchronising timers add
their own waits: the untimed total is printed beside the sum of the rows. A profiler
table of one untimed run follows (device kernels by time, host ops by self time).

    python3 -m bench.everything_stages --images .benchdata/images \
        --model sam2.1_hiera_large --checkpoint /tmp/weights/sam2.1_hiera_large_synthetic.pt
    python3 -m bench.everything_stages --device cpu --model sam2_test_tiny --photos 1  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import models.sam.automatic_pipeline as pipeline
from bench.common import (
    DEFAULT_IMAGES,
    add_decoder_path_flags,
    decoder_paths,
    environment,
    load_photos,
    print_table,
    tf32_matmuls,
    write_json,
)
from models.optimize import compile_fn
from models.sam import SAM_CONFIGS, load_sam
from models.sam.automatic import AutomaticMaskGenerator, AutomaticMaskSettings
from models.sam.automatic_pipeline import GridMaskGenerator
from models.sam.transformer import MATH_ATTENTION_DTYPES
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.automatic import (
    Sam2AutomaticMaskGenerator,
    Sam2AutomaticMaskSettings,
    compiled_call,
    point_decoder,
)

# tf32: fp32 weights, matmuls on TF32 tensor cores (`bench.common.tf32_matmuls`)
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
STAGES = ("encode", "decoder", "filter", "measure", "nms", "paint", "finish other", "to host")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageClock:
    """Wall milliseconds and calls per stage, each call bracketed by device syncs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.candidates = 0  # masks that passed the IoU filter (upscaled by `_measure`)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        sync(self.device)
        started = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.ms[name] += (time.perf_counter() - started) * 1000
            self.calls[name] += 1

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def clocked(generator: GridMaskGenerator[Any], clock: StageClock) -> Iterator[None]:
    """The generator's hooks and the pipeline's NMS wrapped by `clock` while inside."""
    originals = {
        name: getattr(generator, name)
        for name in ("_encode", "_decode", "_measure", "_paint", "decode_chunk", "finish")
    }
    measure = originals["_measure"]

    def counted_measure(low_res: torch.Tensor, job: Any) -> Any:
        clock.candidates += int(low_res.shape[0])
        return measure(low_res, job)

    generator._encode = clock.wrap("encode", originals["_encode"])  # type: ignore[method-assign]
    generator._decode = clock.wrap("decoder", originals["_decode"])  # type: ignore[method-assign]
    generator._measure = clock.wrap("measure", counted_measure)  # type: ignore[method-assign]
    generator._paint = clock.wrap("paint", originals["_paint"])  # type: ignore[method-assign]
    generator.decode_chunk = clock.wrap("decode_chunk", originals["decode_chunk"])  # type: ignore[method-assign]
    generator.finish = clock.wrap("finish", originals["finish"])  # type: ignore[method-assign]
    nms = pipeline.batched_nms
    pipeline.batched_nms = clock.wrap("nms", nms)
    try:
        yield
    finally:
        pipeline.batched_nms = nms
        for name in originals:
            delattr(generator, name)  # back to the class's methods


def stage_rows(clock: StageClock, photos: int) -> list[dict[str, Any]]:
    """Per-photo milliseconds of each stage; the wrappers' overlaps taken out."""
    ms = dict(clock.ms)
    ms["filter"] = ms.get("decode_chunk", 0.0) - ms.get("decoder", 0.0) - ms.get("measure", 0.0)
    ms["finish other"] = ms.get("finish", 0.0) - ms.get("nms", 0.0) - ms.get("paint", 0.0)
    calls = dict(clock.calls)
    calls["filter"] = calls.get("decode_chunk", 0)
    calls["finish other"] = calls.get("finish", 0)
    return [
        {
            "stage": s,
            "ms_per_photo": ms.get(s, 0.0) / photos,
            "calls_per_photo": calls.get(s, 0) / photos,
        }
        for s in STAGES
    ]


def build(args: argparse.Namespace, dtype: torch.dtype) -> GridMaskGenerator[Any]:
    """The model (seeded random weights, or `--checkpoint`) and its generator, Meta's
    default settings but for the thresholds given."""
    fields = {
        "points_per_side": args.points_per_side,
        "points_per_batch": args.points_per_batch,
        "pred_iou_thresh": args.pred_iou_thresh,
        "stability_score_thresh": args.stability_thresh,
    }
    device = torch.device(args.device)
    if args.model in SAM2_CONFIGS:
        sam2 = load_sam2(SAM2_CONFIGS[args.model], args.checkpoint).to(device, dtype)
        sam2.use_decoder_paths(**decoder_paths(args))
        decode = None
        if args.compile:
            sam2.encode = torch.compile(sam2.encode)  # type: ignore[method-assign]
            if args.compile_decoder:  # as the service's Sam2Stages.everything_decode
                decode = compiled_call(compile_fn(point_decoder(sam2), "default", dynamic=None))
        return Sam2AutomaticMaskGenerator(sam2, Sam2AutomaticMaskSettings(**fields), decode)
    if args.model not in SAM_CONFIGS:
        raise SystemExit(f"unknown model {args.model!r}: one of {[*SAM2_CONFIGS, *SAM_CONFIGS]}")
    sam = load_sam(SAM_CONFIGS[args.model], args.checkpoint).to(device, dtype)
    if args.compile:
        sam.encode = torch.compile(sam.encode)  # type: ignore[method-assign]
    return AutomaticMaskGenerator(sam, AutomaticMaskSettings(**fields))


def profile_table(generator: GridMaskGenerator[Any], photo: torch.Tensor, top: int) -> str:
    """The profiler's top device kernels and host ops of one untimed run."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if photo.is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        generator.generate(photo).masks.cpu()
    averages = prof.key_averages()
    parts = []
    if photo.is_cuda:
        parts.append(averages.table(sort_by="self_device_time_total", row_limit=top))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.math_attention:
        MATH_ATTENTION_DTYPES.update({torch.bfloat16, torch.float16})
    photos = [p.to(device) for p in load_photos(args.images)[: args.photos]]
    results: dict[str, Any] = {"env": environment(), "args": vars(args), "dtypes": {}}
    for name in args.dtypes:
        dtype = DTYPES[name]
        generator = build(args, dtype)
        with torch.inference_mode(), tf32_matmuls(name == "tf32"):
            generator.generate(photos[0]).masks.cpu()  # warm-up: compilation, kernel plans
            totals = []
            for photo in photos:  # untimed by stage: the honest total
                sync(device)
                started = time.perf_counter()
                kept = generator.generate(photo).masks.cpu().shape[0]
                totals.append((time.perf_counter() - started) * 1000)
            clock = StageClock(device)
            with clocked(generator, clock):
                for photo in photos:
                    with clock.stage("total"):
                        out = generator.generate(photo)
                        with clock.stage("to host"):
                            out.masks.cpu()
            rows = stage_rows(clock, len(photos))
            summary = {
                "untimed_ms_per_photo": statistics.median(totals),
                "timed_total_ms_per_photo": clock.ms["total"] / len(photos),
                "candidates_per_photo": clock.candidates / len(photos),
                "kept_last_photo": kept,
            }
            print(f"\n{args.model} {name}: {summary}")
            print_table(rows, ["stage", "ms_per_photo", "calls_per_photo"])
            if args.profile:
                print(profile_table(generator, photos[0], args.top))
        results["dtypes"][name] = {"summary": summary, "stages": rows}
        del generator
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--model", default="sam2.1_hiera_large")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: seeded random")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--photos", type=int, default=2)
    p.add_argument("--points-per-side", type=int, default=32)
    p.add_argument("--points-per-batch", type=int, default=64)
    p.add_argument("--pred-iou-thresh", type=float, default=0.8)
    p.add_argument("--stability-thresh", type=float, default=0.95)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--compile-decoder", action="store_true", help="SAM 2: the grid's decoder call too"
    )
    p.add_argument(
        "--math-attention",
        action="store_true",
        help="bf16/fp16 decoders attend through plain matmuls too, as fp32 ones do",
    )
    add_decoder_path_flags(p)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--top", type=int, default=20, help="profiler rows per table")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run(args)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
