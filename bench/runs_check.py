"""The runs kernel (`models/sam/runs_kernel.py`) against the full-size path, on one device.

For each photo size of `--images` (default: ../shared/data/images' photos) and SAM's
two-step resize and SAM 2's single one, random low-res logits (smooth shapes from a few
random 8x8 planes upscaled, so masks have edges rather than noise; `--noise` for random
weights' noise) go both ways: `low_res_runs` (one launch per image size, one sync) and the
path it replaced (`F.interpolate` twice, threshold, `mask_runs`). Prints, per size, the
pixels whose mask differs between the two (float rounding at the threshold), the runs per
mask, and the median milliseconds of each, host and device together. Then the served form
(one copy back, room learnt by `RunsCapacity`) with run lengths and with COCO's strings
written on the device (`models.sam.coco_kernel`, SERVE_MASK_STRINGS): whether the strings
are pycocotools' for the same runs, each form's milliseconds, and what writing the strings
from the run lengths costs a frontend (pycocotools' C writer, `server.rle.counts_string`).

    python -m bench.runs_check --images .benchdata/images --iters 50
    SERVE_DEVICE=cpu TRITON_INTERPRET=1 python -m bench.runs_check --iters 1 --max-side 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench.common import DEFAULT_IMAGES, environment, print_table
from models.sam import SAM_CONFIGS, coco_kernel
from models.sam import transforms as sam_tf
from models.sam.runs_kernel import RunsGroup, compiled_variants
from server.engine.runs import RunsCapacity, low_res_runs, mask_runs
from server.rle import MaskRuns, counts_string


def _ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def full_size_runs(
    low: torch.Tensor,
    order: torch.Tensor,
    group: RunsGroup,
    square: int | None,
    threshold: float = 0.0,
) -> list[MaskRuns]:
    """The path the kernel replaced, as the stages run it without the kernel: sort and
    gather (or output 0 of a single-mask group), upscale, threshold, `mask_runs`.
    tests/models/test_runs_kernel.py holds the kernel to it."""
    rows = list(group.rows)
    if group.multimask:
        ranked = torch.take_along_dim(low[rows, 1:], order[rows][:, :, None, None], dim=1)
    else:
        ranked = low[rows, 0:1]
    if square is None:
        up = F.interpolate(ranked, group.size, mode="bilinear", align_corners=False)
    else:
        up = F.interpolate(ranked, (square, square), mode="bilinear", align_corners=False)
        up = up[..., : group.input_size[0], : group.input_size[1]]
        up = F.interpolate(up, group.size, mode="bilinear", align_corners=False)
    return mask_runs([up.gt(threshold).flatten(0, 1)])


def _differing(a: MaskRuns, b: MaskRuns) -> int:
    def flat(counts: np.ndarray) -> np.ndarray:
        return np.repeat(np.arange(len(counts)) % 2 == 1, counts)

    return sum(
        int(np.count_nonzero(flat(p) != flat(q))) for p, q in zip(a.counts, b.counts, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--prompts", type=int, default=1, help="prompts per image (3 masks each)")
    p.add_argument("--noise", action="store_true", help="random weights' noise masks")
    p.add_argument("--max-side", type=int, default=0, help="shrink the sizes (interpreter)")
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    device = torch.device(os.environ.get("SERVE_DEVICE", "cuda"))
    config = SAM_CONFIGS["vit_b"]
    S, m = config.image_size, 4 * config.embedding_size
    sizes = []
    for path in sorted(args.images.glob("*.jpg")):
        w, h = Image.open(path).size
        if args.max_side:
            scale = min(1.0, args.max_side / max(h, w))
            h, w = max(1, int(h * scale)), max(1, int(w * scale))
        sizes.append((h, w))
    g = torch.Generator().manual_seed(0)
    rows = []
    for h, w in sizes:
        P = args.prompts
        if args.noise:
            low = torch.randn(P, 4, m, m, generator=g) * 4
        else:  # smooth blobs: an 8x8 random field upscaled, so masks have a few edges
            coarse = torch.randn(P * 4, 1, 8, 8, generator=g) * 8
            low = F.interpolate(coarse, (m, m), mode="bicubic").reshape(P, 4, m, m)
        low = low.to(device)
        iou = torch.rand(P, 4, generator=g).to(device)
        order = iou[:, 1:].sort(dim=1, descending=True, stable=True).indices
        input_size = sam_tf.resize_longest_side_size(h, w, S)
        for name, square in (("sam", S), ("sam2", None)):
            group = RunsGroup(list(range(P)), True, input_size, (h, w))

            def fused(
                grp: RunsGroup = group, sq: int | None = square, lo: torch.Tensor = low,
                od: torch.Tensor = order,
            ) -> list[MaskRuns]:  # fmt: skip
                return low_res_runs(lo, od, [grp], 0.0, sq)

            def plain(
                grp: RunsGroup = group, sq: int | None = square, lo: torch.Tensor = low,
                od: torch.Tensor = order,
            ) -> list[MaskRuns]:  # fmt: skip
                return full_size_runs(lo, od, grp, sq)

            learnt = RunsCapacity()  # the room a copy back keeps, as a stage learns it

            def served(
                grp: RunsGroup = group, sq: int | None = square, lo: torch.Tensor = low,
                od: torch.Tensor = order, strings: bool = False, capacity: RunsCapacity = learnt,
            ) -> list[MaskRuns]:  # fmt: skip
                return low_res_runs(lo, od, [grp], 0.0, sq, capacity, strings=strings)

            (a,), (b,) = fused(), plain()
            (written,) = served(strings=True)
            assert a.counts is not None and written.strings is not None
            host_strings = [counts_string(c) for c in a.counts]
            rows.append(
                {
                    "model": name,
                    "size": f"{h}x{w}",
                    "masks": len(a),
                    "runs_per_mask": sum(len(c) for c in a.counts) // len(a),
                    "pixels_differing": _differing(a, b),
                    "areas_equal": bool(np.array_equal(a.areas, b.areas)),
                    "low_res_runs_ms": _ms(fused, args.iters, device),
                    "full_size_ms": _ms(plain, args.iters, device),
                    "strings_equal": written.strings == host_strings,
                    "served_runs_ms": _ms(served, args.iters, device),
                    "served_strings_ms": _ms(partial(served, strings=True), args.iters, device),
                    "frontend_strings_ms": _ms(
                        partial(lambda r: [counts_string(c) for c in r], a.counts),
                        args.iters,
                        torch.device("cpu"),
                    ),
                    "runs_kb": sum(c.nbytes for c in a.counts) // 1024,
                    "strings_kb": sum(len(t) for t in written.strings) // 1024,
                }
            )
            print(rows[-1], flush=True)
    # batches of 1 to 4 prompts on sides that are multiples of 16 and not, single-mask too:
    # the kernel must not compile again for any of them (one per mask count and resize)
    for P in (1, 2, 3, 4):
        low = torch.randn(P, 4, m, m, generator=g).to(device)
        order = torch.zeros(P, 3, dtype=torch.int64).to(device)
        for h, w in ((64, 48), (65, 47)):
            for multimask in (True, False):
                group = RunsGroup(list(range(P)), multimask, (S, S), (h, w))
                for square in (S, None):
                    low_res_runs(low, order, [group], 0.0, square)
                    low_res_runs(low, order, [group], 0.0, square, RunsCapacity(), strings=True)
    print(f"compiled runs kernels: {compiled_variants()} (4 intended: 1 or 3 masks x 2 resizes)")
    print(f"compiled strings kernels: {coco_kernel.compiled_variants()} (2 intended)")
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
