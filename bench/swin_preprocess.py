"""Swin's pre-processing of a batch on the GPU: image by image (tensor ops) against the two
batched kernels (`models.swin.resize_kernel`), as the classifier stage runs them.

Per batch size: the host's time per call (what the stage's thread spends, holding the GIL
for most of it: the engine's event loop waits meanwhile), the GPU's time (CUDA events), and
how far the two paths' outputs are apart and from Pillow's levels. The images are the
photos decoded as the frontends decode them for Swin (`--scaled`, the default: libjpeg's
scaled decode) or whole.

    python -m bench.swin_preprocess --images .benchdata/images --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import DEFAULT_IMAGES, environment, print_table, write_json
from models.images import nested_pixels, packed_on
from models.swin import SWIN_CONFIGS
from models.swin import transforms as swin_tf
from models.swin.resize_kernel import preprocess_packed
from server import imaging


def _photos(folder: Path, scaled: bool, resize_size: int) -> list[np.ndarray]:
    rule = partial(imaging.swin_min_size, resize_size=resize_size) if scaled else None
    out = []
    for path in sorted(folder.glob("*.jpg")):
        data = path.read_bytes()
        decoded = imaging.decode_image(data, max_pixels=10**9, max_bytes=10**9, min_size=rule)
        out.append(np.ascontiguousarray(decoded.pixels))
    if not out:
        raise SystemExit(f"no .jpg photos in {folder}")
    return out


def _pillow(image: np.ndarray, resize: int, crop: int) -> np.ndarray:
    h, w = image.shape[:2]
    newh, neww = swin_tf.resize_shorter_side_size(h, w, resize)
    top, left = swin_tf.center_crop_offsets(newh, neww, crop)
    resized = Image.fromarray(image).resize((neww, newh), Image.Resampling.BICUBIC)
    return np.asarray(resized)[top : top + crop, left : left + crop]


def _time(fn: Any, iters: int) -> tuple[float, float]:
    """(host ms per call, GPU ms per call): medians."""
    fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - began) * 1000)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(gpu)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--model", default="swin_tiny_patch4_window7_224")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--whole", action="store_true", help="decode whole, not scaled")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this compares GPU paths: it needs CUDA")
    config = SWIN_CONFIGS[args.model]
    device = torch.device("cuda")
    photos = _photos(args.images, not args.whole, config.resize_size)
    S, R = config.img_size, config.resize_size
    mean = torch.tensor(config.mean).view(3, 1, 1)
    std = torch.tensor(config.std).view(3, 1, 1)
    rows = []
    for batch in args.batch_sizes:
        images = [torch.from_numpy(photos[k % len(photos)]).pin_memory() for k in range(batch)]
        sizes = [(int(i.shape[0]), int(i.shape[1])) for i in images]

        def tensor_path(images: list[torch.Tensor] = images, sizes: list = sizes) -> torch.Tensor:
            nested = nested_pixels(images, device)
            return swin_tf.preprocess_images(nested, config, device, sizes)

        def kernels(images: list[torch.Tensor] = images, sizes: list = sizes) -> torch.Tensor:
            values, _ = packed_on([i.reshape(-1, 3) for i in images], device)
            return preprocess_packed(values, sizes, config)

        a, b = tensor_path().cpu(), kernels().cpu()
        levels = ((b * std + mean) * 255).round().permute(0, 2, 3, 1).numpy()
        pillow = np.stack([_pillow(i.numpy(), R, S) for i in images])
        off = np.abs(levels - pillow)
        for name, fn in (("image by image", tensor_path), ("two kernels", kernels)):
            host_ms, gpu_ms = _time(fn, args.iters)
            rows.append({
                "path": name, "batch": batch, "host ms": round(host_ms, 3),
                "gpu ms": round(gpu_ms, 3), "host ms/img": round(host_ms / batch, 3),
                "paths apart": round(float((a - b).abs().max()), 4),
                "max levels off Pillow": float(off.max()),
                "share off Pillow": round(float((off > 0.5).mean()), 6),
            })  # fmt: skip
    print_table(rows, list(rows[0]))
    write_json(args.out, {"environment": environment(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
