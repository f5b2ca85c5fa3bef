"""Where a decoder batch of clicks on different images spends its time, on the GPU.

Under open-loop clicks the service's decoder batches took ~38 ms for ~8 prompts while one
click alone takes ~5 ms (docs/BENCHMARKS.md, issue 19). This builds the engine as
`python -m server` does (SAM only), warms it, encodes the photos, then times one decoder
batch of N one-point clicks, each on another photo, multimask, RLE on the device, as served
(the `eager_on_recompile` stance), and splits it:

- `decoder`: prompts packed and the compiled decoder (synchronised after);
- `masks`: every item's full-size masks (sorted, upscaled per group of image sizes);
- `runs`: the device RLE (`mask_runs`, one copy back) and the host's runs per mask;
- `low_res_runs`: the runs made straight from the low-res logits instead, one Triton launch
  per image size (`server.engine.runs.low_res_runs`, the service's default on CUDA), and
  how many pixels its masks differ from the full-size path's by (float rounding at the
  threshold); `batch_full_masks` and `contended_full_masks`: the whole batch with the
  full-size path, for comparison;
- `contended`: the whole batch again while another thread spins in Python, as the engine's
  event loop does under load, with the engine's GIL switch interval.

Then the kernel launches and aten calls of one batch of 1 and 8 clicks with each path, and
a profiler table of the 8 (host ops and kernels), so the fix can be aimed.

    python -m bench.decoder_batch --images .benchdata/images --sizes 1 8 16

SAM 2.1 (`--model`, any SERVE_SAM_MODEL) runs the same batches through `Sam2Stages`, whose
decoder reads the embedding and two high-resolution maps per click; `decoder_ms` (CUDA
graphs, issue 24) against `decoder_no_graph_ms` (the compiled decoder) and their max abs
difference are the columns to read. `--points` clicks per prompt pads the tokens to a
bucket (2 points: 3 tokens in the graphs' 4).

    python -m bench.decoder_batch --model sam2.1_hiera_b+ --sizes 1 8 32 --iters 20
    SERVE_DEVICE=cpu python -m bench.decoder_batch --model sam2_test_tiny --sizes 1 2 --iters 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import DEFAULT_IMAGES, environment, print_table
from models.optimize import EAGER_ON_RECOMPILE
from models.sam import PromptSet
from models.triton_device import runs_triton
from server.domain import Prompt
from server.engine.cache import ImageEmbedding
from server.engine.runs import mask_runs
from server.engine.sam2_stages import Sam2Stages
from server.engine.services import Engine
from server.engine.stages import DecodeItem, EncodeItem, SamStages
from server.imaging import decode_image
from server.metrics import Metrics
from server.rle import MaskRuns
from server.settings import Settings


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _differing_pixels(a: list[MaskRuns], b: list[MaskRuns]) -> int:
    """Pixels set in one and not the other, over every mask of two lists of runs."""
    total = 0
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x.counts, y.counts, strict=True):
            total += int(np.count_nonzero(_decode_counts(p) != _decode_counts(q)))
    return total


def _decode_counts(counts: np.ndarray) -> np.ndarray:
    """COCO counts -> the flat mask (column-major), alternating from a run of zeros."""
    values = np.arange(len(counts)) % 2 == 1
    return np.repeat(values, counts)


def _median_ms(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


Rows = tuple[list[torch.Tensor], ...]  # one list per image input, one row per click


def _decoder(stages: SamStages) -> Callable[[Rows, list[PromptSet]], tuple[torch.Tensor, ...]]:
    """The stages' decoder call (graphs where they fit, else the compiled decoder): SAM's
    over the embeddings, SAM 2's over the embeddings and both high-res maps."""
    sam2 = stages if isinstance(stages, Sam2Stages) else None

    def run(rows: Rows, sets: list[PromptSet]) -> tuple[torch.Tensor, ...]:
        if sam2 is not None:
            embeds, s0, s1 = rows
            return sam2._run_sam2_decoder(embeds, s0, s1, sets)
        return stages._run_decoder(rows[0], sets)

    return run


class _Spinner:
    """A thread that runs Python bytecode without pause: a stand-in for a busy event loop."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n = (n + 1) % 1_000_003

    def __enter__(self) -> _Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def warm_stages(
    images: Path, model: str | None
) -> tuple[SamStages, list[ImageEmbedding], Settings]:
    """The SAM stages built and warmed as `python -m server` does (SAM only), with the
    photos of `images` encoded: the stages, one embedding per photo, the settings."""
    settings = Settings(enable_swin=False, **({"sam_model": model} if model else {}))
    engine = Engine(settings, Metrics())
    asyncio.run(engine.load())
    asyncio.run(engine.warmup())
    assert engine.sam is not None
    stages = engine.sam.stages
    sys.setswitchinterval(settings.switch_interval_ms / 1000.0)
    photos = sorted(images.glob("*.jpg"))
    pixels = [
        decode_image(p.read_bytes(), max_pixels=40_000_000, max_bytes=50 << 20).pixels
        for p in photos
    ]
    entries = stages.encode(
        [EncodeItem(f"img-{k}", pixels[k % len(pixels)]) for k in range(len(pixels))]
    )
    return stages, entries, settings


def click_items(entries: list[ImageEmbedding], n: int, n_max: int, points: int) -> list[DecodeItem]:
    """`n` one-prompt multimask clicks of `points` points, click k on photo k (cycling),
    spread across the photo as k runs to `n_max`."""
    out = []
    for k in range(n):
        e = entries[k % len(entries)]
        h, w = e.original_size
        xy = tuple((w * (0.3 + 0.4 * k / n_max), h * (0.5 - 0.1 * j)) for j in range(points))
        out.append(DecodeItem(e, (Prompt(points=xy, labels=(1,) * points),), multimask=True))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--model", default=None, help="SERVE_SAM_MODEL (default: the settings')")
    p.add_argument("--points", type=int, default=1, help="clicks per prompt")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    stages, entries, settings = warm_stages(args.images, args.model)
    n_max = max(args.sizes)

    def clicks(n: int) -> list[DecodeItem]:
        return click_items(entries, n, n_max, args.points)

    rows = []
    run_decoder = _decoder(stages)
    with EAGER_ON_RECOMPILE.hold(), torch.inference_mode():
        for n in args.sizes:
            items = clicks(n)
            features: Rows = tuple(
                list(t) for t in zip(*(i.embedding.tensors for i in items), strict=True)
            )
            sets = [stages._prompt_set(i.prompts[0], i.embedding, None) for i in items]
            for _ in range(3):
                stages.decode(items)
            whole = _median_ms(lambda items=items: stages.decode(items), args.iters)
            low_res, iou = run_decoder(features, sets)
            decoder = _median_ms(lambda f=features, s=sets: run_decoder(f, s), args.iters)
            # the same batch without the decoder's CUDA graphs (the compiled decoder alone),
            # and how far the graphs' answer is from it
            graphs, stages._graphs = stages._graphs, None
            compiled_ms = _median_ms(lambda f=features, s=sets: run_decoder(f, s), args.iters)
            plain_low_res, plain_iou = run_decoder(features, sets)
            stages._graphs = graphs
            graph_diff = max(
                (low_res - plain_low_res).abs().max().item(), (iou - plain_iou).abs().max().item()
            )

            def masks(
                items: list[DecodeItem] = items,
                low_res: torch.Tensor = low_res,
                iou: torch.Tensor = iou,
            ) -> list[torch.Tensor]:
                return stages._sorted_masks(items, low_res, iou)[0]

            mask_ms = _median_ms(masks, args.iters)
            stacks = [m.flatten(0, 1) for m in masks() if m is not None]
            runs_ms = _median_ms(lambda s=stacks: mask_runs(s), args.iters)
            plain_runs = mask_runs(stacks)
            total_runs = sum(len(r) for m in plain_runs for r in m.counts)
            everyone = list(range(n))
            fused_ms: float | None = None
            differing: int | None = None
            if runs_triton(stages.device):  # the kernel runs here (CUDA, or the interpreter)
                fused_ms = _median_ms(
                    lambda i=items, lo=low_res, io=iou, e=everyone: stages._runs_from_low_res(
                        i, lo, io, e
                    ),
                    args.iters,
                )
                fused = stages._runs_from_low_res(items, low_res, iou, everyone)
                differing = _differing_pixels([fused[k] for k in everyone], plain_runs)
            with _Spinner():
                contended = _median_ms(lambda items=items: stages.decode(items), args.iters)
            # the whole batch again with the runs made from the full-size masks
            was, stages.fused_runs = stages.fused_runs, False
            whole_plain = _median_ms(lambda items=items: stages.decode(items), args.iters)
            with _Spinner():
                contended_plain = _median_ms(lambda items=items: stages.decode(items), args.iters)
            stages.fused_runs = was
            rows.append(
                {
                    "model": settings.sam_model,
                    "clicks": n,
                    "batch_ms": whole,
                    "decoder_ms": decoder,
                    "decoder_no_graph_ms": compiled_ms,
                    "graph_vs_no_graph_max_abs": graph_diff,
                    "graphed": graphs is not None,
                    "masks_ms": mask_ms,
                    "runs_ms": runs_ms,
                    "low_res_runs_ms": fused_ms,
                    "low_res_runs": stages.fused_runs,
                    "batch_full_masks_ms": whole_plain,
                    "contended_ms": contended,
                    "contended_full_masks_ms": contended_plain,
                    "pixels_differing": differing,
                    "runs_per_mask": total_runs // max(1, 3 * n),
                }
            )
            print(rows[-1], flush=True)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        was = stages.fused_runs
        for clicks_n, fused_runs in ((1, False), (1, was), (8, False), (8, was)):
            items = clicks(clicks_n)
            stages.fused_runs = fused_runs
            with profile(activities=activities) as prof:
                stages.decode(items)
                _sync()
            averages = prof.key_averages()
            launches = sum(
                e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                       "cudaLaunchKernelExC", "cuLaunchKernelEx")
            )  # fmt: skip
            calls = sum(e.count for e in averages if e.key.startswith("aten::"))
            print(f"one batch of {clicks_n} clicks, runs from low-res logits {fused_runs}: "
                  f"{launches} kernel launches, {calls} aten calls")  # fmt: skip
        for key in ("self_cpu_time_total", "self_device_time_total"):
            if key == "self_device_time_total" and not torch.cuda.is_available():
                continue
            table = averages.table(sort_by=key, row_limit=args.profile_rows,
                                   max_name_column_width=60)  # fmt: skip
            print(f"--- one batch of 8 clicks: top by {key}\n{table}", flush=True)
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
