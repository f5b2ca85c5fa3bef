"""How the served int8 SAM encoder's fixed MLP scales (models.mlp_static) should be
calibrated: on what, and with how much room above the largest value seen.

Why: the service calibrates lin2's per-channel input scales at load on two `smooth_images`
(synthetic, no photo at hand). On an H200 that variant's masks met IoU 0.9845 on the
photos against 0.988 for per-token scales (docs/BENCHMARKS.md, issue 20), and white noise
reached 2.5x the calibrated peaks on the tiny model (tests/models/test_mlp_static.py). If
real photos saturate channels that smooth images never drive as hard, more headroom or
other calibration images recover the loss; if not, the loss is the scales' own.

Each row prepares a copy of SAM ViT-B's encoder as the service does for
`SERVE_QUANTIZATION=int8` on CUDA (the per-layer choice, the norms quantising qkv's and
lin1's input, GELU in lin1, `mlp_static`), the arithmetic in torch on this device (the
CUDA kernels compute the same products; their GELU is the tanh form), and compares it
with fp32 through models.fidelity.compare_sam on the photos (five prompts each, all four
masks). Rows: per-token scales (the form served before) calibrated on 2 smooth images
and on the photos mirrored left to right (the per-layer choice, GPTQ and bias correction
use the calibration images too), then fixed scales calibrated on `--smooth` synthetic
images (of the kind `--synthetic` names: smooth, as served, or dead leaves) or on the photos
mirrored, at each `--headroom`; `--seed` another random ViT-B.
About 2 minutes a row on a 2-core CPU for the 7 photos.

    python -m bench.sam_static_calibration --images .benchdata/images
    python -m bench.sam_static_calibration --images .benchdata/images --no-per-token \
        --no-photos --smooth 8 --headroom 1.5 --max-kept 0   # the float layers' worth
    python -m bench.sam_static_calibration --images .benchdata/images --no-per-token \
        --smooth 8 --headroom 1.5 --proj all windowed global  # proj_static's cost
    python -m bench.sam_static_calibration --images .benchdata/images --no-per-token \
        --no-photos --smooth --headroom --max-kept 0 --kept-with-proj  # both at once
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from bench.common import environment, print_table, write_json
from bench.sam_fp8_sensitivity import fp32_reference, photo_arguments
from models import int8_select, mlp_static, quantize
from models.fidelity import compare_sam, eager_sam_runner
from models.int8_select import calibration_on, calibration_run
from models.quantize import INT8_MAX_KEPT, quantize_linears
from models.sam import Sam
from models.sam.transforms import preprocess_images

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _blocks(name: str, layer: nn.Linear) -> bool:
    return name.startswith("blocks.")  # models.optimize's encoder filter


def prepared(
    base: Sam,
    static: bool,
    calibrate: Any,
    headroom: float,
    max_kept: float | None = None,
    proj_blocks: str | None = None,
    proj_headroom: float | None = None,
) -> Sam:
    """A copy of `base` whose encoder is quantised as the service's int8 variant (at most
    `max_kept` of its layers left in float by the per-layer choice; with `proj_blocks`,
    those blocks' output projections by fixed scales too: `OptimizeOptions.proj_static`,
    at `proj_headroom` over their peaks where given, else `quantize.PROJ_HEADROOM`)."""
    model = copy.deepcopy(base)
    served = mlp_static.HEADROOM, quantize.PROJ_STATIC_BLOCKS, quantize.PROJ_HEADROOM
    mlp_static.HEADROOM = headroom
    quantize.PROJ_STATIC_BLOCKS = proj_blocks or "all"
    if proj_headroom is not None:
        quantize.PROJ_HEADROOM = proj_headroom
    try:
        quantize_linears(model.image_encoder, "int8", _blocks, calibrate=calibrate,
                         norm_quant=True, mlp_static=static, max_kept=max_kept,
                         proj_static=proj_blocks is not None)  # fmt: skip
    finally:
        mlp_static.HEADROOM, quantize.PROJ_STATIC_BLOCKS, quantize.PROJ_HEADROOM = served
    return model


def peak_ratios(
    encoder: nn.Module, calibrate: Any, photos: Any, headroom: float = 1.5
) -> list[dict[str, Any]]:
    """Each fixed-scale candidate's input (lin2, the attention's proj) on the photos against
    what `calibrate` showed, channel by channel: the largest ratio of the photos' peak to
    the calibration's, and the share of channels past `headroom` (whose largest values
    saturate at +-127)."""
    from models.mlp_hop import mlp_second_layers

    names = [*sorted(mlp_second_layers(encoder)), *quantize.attention_projections(encoder)]
    seen = mlp_static.input_amax(encoder, lambda: calibrate(encoder), names)
    real = mlp_static.input_amax(encoder, lambda: photos(encoder), names)
    rows = []
    for name in names:
        ratio = real[name].float() / seen[name].float().clamp(min=1e-8)
        past = float((ratio > headroom).float().mean())
        rows.append({"layer": name, "max ratio": round(float(ratio.max()), 2),
                     "median ratio": round(float(ratio.median()), 2),
                     f"share past {headroom:g}x": round(past, 4)})  # fmt: skip
    return rows


class Row(NamedTuple):
    """One row of the plan: how its copy of the encoder is quantised (`prepared`)."""

    label: str
    static: bool  # lin2 by fixed scales
    calibrate: Any
    headroom: float
    max_kept: float  # share of layers kept in float at most
    proj_blocks: str | None = None  # whose projections take fixed scales too
    proj_headroom: float | None = None  # theirs, where not `quantize.PROJ_HEADROOM`


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    photo_arguments(p)
    # `--smooth` from before `--synthetic` chose the kind; the commands in BENCHMARKS use it
    p.add_argument("--synthetic-images", "--smooth", dest="smooth", nargs="*", type=int,
                   default=[2, 8], metavar="N",
                   help="calibrate on this many synthetic images (the service: 8)")  # fmt: skip
    p.add_argument("--headroom", nargs="*", type=float, default=[1.0, 1.5])
    p.add_argument("--no-photos", action="store_true", help="skip the mirrored-photo rows")
    p.add_argument("--no-per-token", action="store_true", help="skip the per-token rows")
    p.add_argument(
        "--max-kept", nargs="*", type=float, default=[],
        help="also the served form (fixed scales, 8 synthetic images, 1.5x) with at most this "
        "share of layers kept in float (served: INT8_MAX_KEPT)",
    )  # fmt: skip
    p.add_argument(
        "--proj", nargs="*", choices=["all", "windowed", "global"], default=[],
        help="also the served form with these blocks' output projections by fixed scales\n"
        "(proj_static), calibrated on 8 synthetic images and (for all) on the photos mirrored",
    )  # fmt: skip
    p.add_argument(
        "--proj-headroom", nargs="*", type=float, default=[],
        help="also every projection by fixed scales at this headroom over its peaks\n"
        "(lin2's stays 1.5; 8 synthetic images)",
    )  # fmt: skip
    p.add_argument(
        "--kept-with-proj", action="store_true",
        help="the --max-kept rows with every projection by fixed scales too (proj_static)",
    )  # fmt: skip
    p.add_argument(
        "--peaks", action="store_true",
        help="first, each fixed-scale candidate's peaks on the photos against 8 synthetic images'",
    )  # fmt: skip
    p.add_argument(
        "--synthetic", choices=["smooth", "leaves"], default="smooth",
        help="the synthetic calibration images (int8_select.SYNTHETIC): smooth by default, "
        "as the commands recorded in docs/BENCHMARKS.md ran; SAM's served: leaves",
    )  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    synth = int8_select.SYNTHETIC = args.synthetic
    started = time.perf_counter()
    base, photos, reference = fp32_reference(args, started)
    size = base.config.image_size
    mirrored, _ = preprocess_images([ph.flip(1) for ph in photos], base.config, DEVICE)
    on_photos = calibration_on(mirrored, chunk=1)

    def synthetic(n: int, chunk: int | None = None) -> Any:
        return calibration_run(size, n, chunk=chunk, padded=True)  # as SAM's load does

    if args.peaks:
        upright, _ = preprocess_images(photos, base.config, DEVICE)  # the fidelity set itself
        with torch.inference_mode():
            peaks = peak_ratios(base.image_encoder, synthetic(8, chunk=1),
                                calibration_on(upright, chunk=1))  # fmt: skip
        print_table(peaks, list(peaks[0]))

    plan: list[Row] = []
    served = INT8_MAX_KEPT
    if not args.no_per_token:
        plan.append(Row(f"per-token, 2 {synth} images", False, synthetic(2), 1.0, served))
        if not args.no_photos:  # how much of the photos' gain is the per-layer choice's
            plan.append(Row("per-token, the photos mirrored", False, on_photos, 1.0, served))
    for headroom in args.headroom:
        for n in args.smooth:
            plan.append(Row(f"fixed, {n} {synth} images", True, synthetic(n),
                            headroom, served))  # fmt: skip
        if not args.no_photos:
            plan.append(Row("fixed, the photos mirrored", True, on_photos, headroom, served))
    room = quantize.PROJ_HEADROOM  # the projections' own (served: 3x)
    for kept in args.max_kept:  # what the layers kept in float buy
        proj = "all" if args.kept_with_proj else None
        label = f", proj too (all, {room}x)" if proj else ""
        plan.append(Row(f"fixed{label}, 8 {synth} images, {kept:g} kept", True,
                        synthetic(8), 1.5, kept, proj))  # fmt: skip
    for blocks in args.proj:  # the attention writing proj's input int8 (proj_static)
        plan.append(Row(f"fixed, proj too ({blocks}, {room}x), 8 {synth} images", True,
                        synthetic(8), 1.5, served, blocks))  # fmt: skip
        if blocks == "all" and not args.no_photos:
            plan.append(Row(f"fixed, proj too (all, {room}x), the photos mirrored", True,
                            on_photos, 1.5, served, blocks))  # fmt: skip
    for own in args.proj_headroom:
        plan.append(Row(f"fixed, proj too (all) at {own:g}x, 8 {synth} images", True,
                        synthetic(8), 1.5, served, "all", own))  # fmt: skip
    rows: list[dict[str, Any]] = []
    for row in plan:
        model = prepared(base, row.static, row.calibrate, row.headroom, row.max_kept,
                         row.proj_blocks, row.proj_headroom)  # fmt: skip
        result = compare_sam(reference, eager_sam_runner(model, DEVICE), photos)
        elapsed = round(time.perf_counter() - started)
        rows.append({"scales": row.label, "headroom": row.headroom, "max_kept": row.max_kept,
                     **result.measures(), "at_s": elapsed})  # fmt: skip
        print(rows[-1], flush=True)
        del model
    cols = ["scales", "headroom", "max_kept", "embedding_rel_error", "mask_iou_mean",
            "mask_iou_min"]  # fmt: skip
    print_table(rows, [*cols, "score_diff_mean"])
    write_json(args.json, {"environment": environment(), "args": vars(args) | {"json": None},
                           "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
