"""What decoding a JPEG at the size the model needs costs in fidelity, and saves in time.

The frontend may decode a JPEG at 1/2, 1/4 or 1/8 of its size (libjpeg-turbo's DCT
scaling) when the model's resize would shrink it anyway, chosen so the model input keeps
its exact size (`server.imaging.sam_min_size`, `swin_min_size`). The pixels then
differ a little from resizing the whole decode: this script measures how much, on real
photos and the same weights, model by model.

- SAM: every photo's five fidelity prompts (all four mask outputs each), masks at the
  photo's own size from the scaled pixels' embedding, against the whole decode's (mask
  IoU, embedding relative error, predicted-IoU difference).
- Swin: the photos and their mirror images, scaled vs whole (top-1 agreement, logit error).
- Decode time of each photo whole and scaled (median of `--repeats`, one thread).

Only photos the rule scales count in a model's figures (the others decode identically).

    python -m bench.decode_scale --sam-model vit_tiny --swin-model swin_tiny_patch4_window7_224
    python -m bench.decode_scale --sam-model vit_b --device cuda   # on a GPU
    python -m bench.decode_scale --sam-model vit_b --swin-model '' --nvjpeg  # + nvJPEG's
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_IMAGES, environment, host_time_ms, print_table, write_json
from models.fidelity import compare_sam, compare_swin, eager_sam_runner, eager_swin_runner
from models.sam import SAM_CONFIGS, Sam, load_sam
from models.swin import SWIN_CONFIGS, load_swin
from server import imaging
from server.engine.jpeg import nvjpeg_decoder
from server.http import jpeg_pass

log = logging.getLogger("bench.decode_scale")

MAX_PIXELS, MAX_BYTES = 100_000_000, 200 << 20
Rule = Callable[[int, int], tuple[int, int] | None]


def decode(data: bytes, rule: Rule | None = None) -> imaging.DecodedImage:
    return imaging.decode_image(data, max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES, min_size=rule)


def tensor(decoded: imaging.DecodedImage) -> torch.Tensor:
    return torch.from_numpy(decoded.pixels)


def timing(name: str, data: bytes, rule: Rule, repeats: int) -> dict[str, Any]:
    whole, scaled = decode(data), decode(data, rule)
    whole_ms = host_time_ms(lambda: decode(data), repeats)
    scaled_ms = host_time_ms(lambda: decode(data, rule), repeats)
    return {
        "photo": name,
        "size": f"{whole.width}x{whole.height}",
        "pixels": "x".join(map(str, scaled.pixel_size)),
        "whole_ms": whole_ms,
        "scaled_ms": scaled_ms,
        "saved_ms": whole_ms - scaled_ms,
    }


def sam_rows(files: dict[str, bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    """SAM's masks from the frontends' scaled decode, photo by photo, with its timing; with
    `--nvjpeg`, then from the engine's nvJPEG pixels (`SERVE_JPEG_DECODE`, CUDA only) on
    the photos a frontend would pass undecoded. Both against libjpeg-turbo's whole decode."""
    config = SAM_CONFIGS[args.sam_model]
    device = torch.device(args.device)
    model = load_sam(config, args.sam_checkpoint, seed=args.seed).to(device).eval()
    rule = partial(imaging.sam_min_size, image_size=config.image_size)

    def scaled(data: bytes) -> torch.Tensor | None:
        pixels = decode(data, rule)
        return tensor(pixels) if pixels.scaled else None

    rows = compare_sam_pixels(model, device, files, scaled, args.sam_model, "")
    for row in rows[:-1]:
        row |= timing(row["photo"], files[row["photo"]], rule, args.repeats)
    if args.nvjpeg:
        gpu_decode = nvjpeg_decoder(device)
        limits = {"max_pixels": MAX_PIXELS, "max_bytes": MAX_BYTES}

        def on_gpu(data: bytes) -> torch.Tensor | None:
            if jpeg_pass.engine_decodable(data, **limits) is None:
                return None  # progressive, rotated, ...: the frontends decode it
            (pixels,) = gpu_decode([torch.frombuffer(bytearray(data), dtype=torch.uint8)])
            return pixels.cpu().contiguous()

        rows += compare_sam_pixels(model, device, files, on_gpu, args.sam_model, " (nvJPEG)")
    return rows


def compare_sam_pixels(
    model: Sam,
    device: torch.device,
    files: dict[str, bytes],
    pixels_of: Callable[[bytes], torch.Tensor | None],
    model_name: str,
    label: str,
) -> list[dict[str, Any]]:
    """One row per photo `pixels_of` gives pixels for (None: skipped), then ALL: masks
    from those pixels against the whole decode's."""
    candidate_of: dict[int, torch.Tensor] = {}
    photos: list[tuple[str, torch.Tensor]] = []
    for name, data in files.items():
        pixels = pixels_of(data)
        if pixels is None:
            continue
        whole = tensor(decode(data))
        candidate_of[id(whole)] = pixels
        photos.append((name, whole))
    if not photos:
        return []
    reference = eager_sam_runner(model, device)
    candidate = eager_sam_runner(model, device, pixels_for=lambda photo: candidate_of[id(photo)])
    rows = [
        {"model": model_name, "photo": name} | asdict(compare_sam(reference, candidate, [whole]))
        for name, whole in photos
    ]
    total = compare_sam(reference, candidate, [p for _, p in photos])
    rows.append({"model": model_name, "photo": "ALL"} | asdict(total))
    for row in rows:
        row["photo"] += label
    return rows


def swin_rows(files: dict[str, bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    config = SWIN_CONFIGS[args.swin_model]
    device = torch.device(args.device)
    model = load_swin(config, args.swin_checkpoint, seed=args.seed).to(device).eval()
    run = eager_swin_runner(model, config, device)
    rule = partial(imaging.swin_min_size, resize_size=config.resize_size)
    scaled_of: dict[int, torch.Tensor] = {}  # a whole view -> the same view, scaled decode

    def candidate(views: Sequence[torch.Tensor]) -> torch.Tensor:
        return run([scaled_of[id(v)] for v in views])

    every: list[torch.Tensor] = []
    rows = []
    for name, data in files.items():
        scaled = decode(data, rule)
        if not scaled.scaled:
            continue
        whole, small = tensor(decode(data)), tensor(scaled)
        views = [whole, whole.flip(1).contiguous()]  # the photo and its mirror image
        scaled_of[id(views[0])], scaled_of[id(views[1])] = small, small.flip(1).contiguous()
        every += views
        row = {"model": args.swin_model, "photo": name} | asdict(
            compare_swin(run, candidate, views)
        )
        row |= timing(name, data, rule, args.repeats)
        rows.append(row)
    if every:
        total = compare_swin(run, candidate, every)
        rows.append({"model": args.swin_model, "photo": "ALL"} | asdict(total))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    parser.add_argument("--sam-model", default="vit_tiny", help="'' to skip SAM")
    parser.add_argument("--sam-checkpoint", type=Path)
    parser.add_argument("--swin-model", default="swin_tiny_patch4_window7_224", help="'' skips")
    parser.add_argument("--swin-checkpoint", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15, help="decodes timed per photo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument(
        "--nvjpeg", action="store_true",
        help="also SAM's masks from nvJPEG's pixels (the engine's decoder; CUDA only)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)
    paths = sorted(p for p in args.images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    if not paths:
        raise SystemExit(f"no JPEG photos in {args.images} (pass --images)")
    files = {p.name: p.read_bytes() for p in paths}
    rows: list[dict[str, Any]] = []
    if args.sam_model:
        rows += sam_rows(files, args)
    if args.swin_model:
        rows += swin_rows(files, args)
    env = environment()
    weights = "checkpoints" if args.sam_checkpoint or args.swin_checkpoint else "seeded random"
    log.info("%s (%s), torch %s, %s, weights: %s", args.device, env["device"], env["torch"],
             env["date"], weights)  # fmt: skip
    sam = [r for r in rows if "mask_iou_mean" in r]
    swin = [r for r in rows if "top1_agreement" in r]
    times = ["size", "pixels", "whole_ms", "scaled_ms", "saved_ms"]
    if sam:
        print_table(sam, ["model", "photo", "masks", "mask_iou_mean", "mask_iou_min",
                          "embedding_rel_error", "score_diff_max", *times])  # fmt: skip
    if swin:
        print_table(swin, ["model", "photo", "views", "top1_agreement", "logit_rel_error",
                           "logit_max_abs_error", *times])  # fmt: skip
    write_json(args.json, {"environment": env, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
