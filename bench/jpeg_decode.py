"""Where a photo's JPEG decode should run: a frontend's libjpeg-turbo, or the GPU's nvJPEG.

A frontend spends about half its CPU on a classify or segment request decoding the JPEG
(BENCHMARKS.md, "A frontend's CPU per request"), and at 2,000 classify/s eight frontends
run out of cores. This script measures both ways on the same photos:

- `host`: `server.imaging.decode_image` as a frontend calls it (libjpeg-turbo, at the
  scale the model's resize allows: `--rule sam`, `swin` or `whole`), one thread;
- `nvjpeg-N`: the engine's decoder (`server.engine.jpeg`: torchvision's batched nvJPEG,
  the hardware decoder of an A100/H100 for baseline JPEGs, CUDA with Huffman decoding on
  the host for progressive ones) on batches of N photos, each then pre-processed on the
  GPU by the model's own transform (SAM ViT-B, Swin-T), as the engine would;
- with CUDA, the pixels' distance from libjpeg-turbo's (per photo, in 8-bit levels).

Each row: images per second of wall time, and the calling process's CPU milliseconds
per image (user + system, all its threads), which is what the decode would take from a
frontend or from the engine process. Photos are repeated to fill a batch.

    python -m bench.jpeg_decode --images .benchdata/images --batch-sizes 1 8 32 64
    python -m bench.jpeg_decode --photos passed   # only what the engine would get
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_IMAGES, environment, print_table, write_json
from models.sam import SAM_CONFIGS
from models.sam import transforms as sam_tf
from models.swin import SWIN_CONFIGS
from models.swin import transforms as swin_tf
from server import imaging
from server.engine import jpeg
from server.engine.jpeg import Decode
from server.http import jpeg_pass

log = logging.getLogger("bench.jpeg_decode")

MAX_PIXELS, MAX_BYTES = 100_000_000, 200 << 20
SAM, SWIN = SAM_CONFIGS["vit_b"], SWIN_CONFIGS["swin_tiny_patch4_window7_224"]
# the frontend's scale for each model (`server.http.routes._min_size`); whole: none
RULES: dict[str, Callable[[int, int], tuple[int, int] | None] | None] = {
    "whole": None,
    "sam": partial(imaging.sam_min_size, image_size=SAM.image_size),
    "swin": partial(imaging.swin_min_size, resize_size=SWIN.resize_size),
}


def read_jpegs(folder: Path, which: str) -> list[tuple[str, bytes]]:
    """The folder's JPEGs; `passed`: only those a frontend passes to the engine undecoded
    (`server.http.jpeg_pass`: upright baseline files)."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    photos = [(p.name, p.read_bytes()) for p in files]
    if which == "passed":
        limits = {"max_pixels": MAX_PIXELS, "max_bytes": MAX_BYTES}
        photos = [(n, d) for n, d in photos if jpeg_pass.engine_decodable(d, **limits)]
    if not photos:
        raise SystemExit(f"no JPEG photos ({which}) in {folder} (pass --images)")
    return photos


def measure(work: Callable[[], int], seconds: float) -> dict[str, float]:
    """Run `work` (returns the images it did) for about `seconds`; rates by wall and CPU."""
    work()  # warm: first calls build decoders and buffers
    images = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        images += work()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        "images": images,
        "img_per_s": round(images / wall, 1),
        "cpu_ms_per_img": round(1000 * cpu / images, 3),
        "wall_ms_per_img": round(1000 * wall / images, 3),
    }


def host_work(jpegs: Sequence[bytes], rule: str) -> Callable[[], int]:
    def work() -> int:
        for data in jpegs:
            imaging.decode_image(
                data, max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES, min_size=RULES[rule]
            )
        return len(jpegs)

    return work


def preprocessed(image: torch.Tensor, rule: str) -> torch.Tensor:
    """The engine's first step on a decoded `[H, W, 3]` photo: the model's own
    pre-processing (resize, crop or pad, normalise) on its device; whole: none."""
    if rule == "sam":
        return sam_tf.preprocess_images([image], SAM, image.device)[0]
    if rule == "swin":
        return swin_tf.preprocess_images([image], SWIN, image.device)
    return image


def as_tensors(jpegs: Sequence[bytes]) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in jpegs]


def nvjpeg_work(decode: Decode, jpegs: Sequence[bytes], batch: int, rule: str) -> Callable[[], int]:
    """The engine's decode (`server.engine.jpeg.nvjpeg_decoder`) on batches of `batch`
    files, then each image pre-processed on the GPU for the model."""
    tensors = as_tensors(jpegs)
    batches = [
        [tensors[(start + i) % len(tensors)] for i in range(batch)]
        for start in range(0, len(tensors), max(1, min(batch, len(tensors))))
    ]

    def work() -> int:
        done = 0
        for chunk in batches:
            for image in decode(chunk):
                preprocessed(image, rule)
            done += len(chunk)
        torch.cuda.synchronize()
        return done

    return work


def fidelity(decode: Decode, photos: Sequence[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """How far nvJPEG's pixels are from libjpeg-turbo's whole decode (the frontends' with
    `SERVE_SCALED_DECODE=false`), photo by photo, in 8-bit levels."""
    rows = []
    for (name, data), image in zip(photos, decode(as_tensors([d for _, d in photos])), strict=True):
        host = imaging.decode_image(data, max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES).pixels
        diff = (image.cpu().int() - torch.from_numpy(host).int()).abs()
        rows.append({
            "photo": name,
            "size": "x".join(map(str, host.shape[1::-1])),
            "mean_abs": round(float(diff.float().mean()), 3),
            "p99_abs": float(diff.float().quantile(0.99)) if diff.numel() < 2**24 else None,
            "max_abs": int(diff.max()),
        })  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    photos = read_jpegs(args.images, args.photos)
    jpegs = [data for _, data in photos]
    decode = jpeg.nvjpeg_decoder(torch.device(args.device)) if args.device == "cuda" else None
    rows: list[dict[str, Any]] = []
    for rule in args.rules:
        host = measure(host_work(jpegs, rule), args.seconds)
        rows.append({"path": "host", "rule": rule, **host})
        if decode is None:
            continue
        for batch in args.batch_sizes:
            work = nvjpeg_work(decode, jpegs, batch, rule)
            rows.append({"path": f"nvjpeg-{batch}", "rule": rule, **measure(work, args.seconds)})
    payload = {"environment": environment(), "photos": [n for n, _ in photos], "rows": rows}
    if decode is not None:
        payload["fidelity"] = fidelity(decode, photos)
    return payload


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rules", nargs="+", choices=sorted(RULES), default=["swin", "sam"])
    parser.add_argument(
        "--photos", choices=["all", "passed"], default="all",
        help="passed: only the JPEGs a frontend hands to the engine (upright baseline)",
    )  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seconds", type=float, default=3.0, help="per row")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the rows")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    payload = run(args)
    if args.out is not None:
        write_json(args.out, payload)
    if "fidelity" in payload:
        print_table(payload["fidelity"], ["photo", "size", "mean_abs", "p99_abs", "max_abs"])
    columns = ["path", "rule", "images", "img_per_s", "cpu_ms_per_img", "wall_ms_per_img"]
    print_table(payload["rows"], columns)
    return payload


if __name__ == "__main__":
    main()
