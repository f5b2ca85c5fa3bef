"""What one segment request costs the host, piece by piece, on this machine's CPU.

Under load on the GPU the service is bound by host work sharing one GIL (docs/BENCHMARKS.md),
so these per-request costs set its ceiling: decoding the JPEG, writing each mask's COCO
counts string, and rendering the JSON body. Masks come in two kinds: a smooth object mask
(what trained weights give) and a noise-like one with as many runs as random weights give
(about 165,000 for a 2048x1365 photo). Each figure is the median over `--iters` calls in
one thread, nothing else running.

    python -m bench.host_costs --iters 20
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pycocotools import mask as mask_utils

from bench.common import DEFAULT_IMAGES, environment, host_time_ms, print_table
from server.imaging import decode_image
from server.rle import counts_string


def numpy_counts_string(counts: np.ndarray) -> str:
    """The vectorised numpy writer the service used before pycocotools' C writer, kept here
    as the comparison: deltas from the count two back, 5 bits a character, offset 48."""
    x = np.asarray(counts, dtype=np.int64).copy()
    if x.size > 3:
        x[3:] -= np.asarray(counts, dtype=np.int64)[1:-2]
    chars = np.zeros((x.size, 13), dtype=np.uint8)
    valid = np.zeros((x.size, 13), dtype=bool)
    active = np.ones(x.size, dtype=bool)
    for j in range(13):
        c = x & 0x1F
        x >>= 5
        more = np.where(c & 0x10, x != -1, x != 0)
        chars[:, j] = (c | (more.astype(np.int64) << 5)) + 48
        valid[:, j] = active
        active &= more
        if not active.any():
            break
    return chars[valid].tobytes().decode("ascii")


def column_runs(mask: np.ndarray) -> np.ndarray:
    """COCO run lengths of a bool `[H, W]` mask (column-major, starting with zeros)."""
    flat = mask.T.reshape(-1)
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    runs = np.diff(np.concatenate(([0], changes, [flat.size])))
    return np.concatenate(([0], runs)) if flat[0] else runs


def smooth_mask(height: int, width: int) -> np.ndarray:
    ys, xs = np.ogrid[:height, :width]
    return ((ys - height / 2) / (height / 3)) ** 2 + ((xs - width / 2) / (width / 4)) ** 2 < 1


def noise_mask(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Alternating runs of 1 to 33 pixels down the columns: ~165,000 runs at 2048x1365."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 34, size=height * width // 8)
    bits = np.repeat(np.arange(lengths.size) % 2 == 1, lengths)[: height * width]
    return bits.reshape(width, height).T.copy()


def segment_body(masks: list[np.ndarray]) -> dict[str, Any]:
    """A segment response as the service writes it, one box with three masks."""
    h, w = masks[0].shape
    objects = [
        {
            "segmentation": {"size": [h, w], "counts": counts_string(column_runs(m))},
            "score": 0.91,
            "area": int(m.sum()),
            "bbox": [1.0, 2.0, 300.0, 400.0],
        }
        for m in masks
    ]
    return {
        "model": {"name": "sam_vit_b", "precision": "bf16"},
        "image": {"image_id": "0" * 64, "width": w, "height": h},
        "results": [{"masks": objects}],
        "timing_ms": {"encode": 12.5, "decode": 3.25},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    print(environment(), flush=True)
    rows: list[dict[str, Any]] = []
    for path in sorted(args.images.glob("*.jpg")):
        data = path.read_bytes()
        decoded = decode_image(data, max_pixels=40_000_000, max_bytes=50 << 20)
        ms = host_time_ms(
            lambda d=data: decode_image(d, max_pixels=40_000_000, max_bytes=50 << 20), args.iters
        )
        mp = decoded.width * decoded.height / 1e6
        rows.append({"step": f"decode {path.name} ({mp:.1f} MP)", "ms": ms})

    height, width = 1365, 2048
    for kind, mask in (
        ("smooth", smooth_mask(height, width)),
        ("noise", noise_mask(height, width)),
    ):
        runs = column_runs(mask)
        assert counts_string(runs) == numpy_counts_string(runs)
        fortran = np.asfortranarray(mask[:, :, None].astype(np.uint8))
        label = f"{kind} mask, {runs.size:,} runs"
        rows.append(
            {
                "step": f"{label}: pycocotools encode (full mask)",
                "ms": host_time_ms(lambda f=fortran: mask_utils.encode(f), args.iters),
            }
        )
        rows.append(
            {
                "step": f"{label}: counts string, numpy (before)",
                "ms": host_time_ms(lambda r=runs: numpy_counts_string(r), args.iters),
            }
        )
        rows.append(
            {
                "step": f"{label}: counts string, pycocotools C (now)",
                "ms": host_time_ms(lambda r=runs: counts_string(r), args.iters),
            }
        )
        body = segment_body([mask, mask, mask])
        size_kb = len(orjson.dumps(body)) / 1024
        rows.append(
            {
                "step": f"{kind} body, 3 masks ({size_kb:,.0f} KB): json.dumps (before)",
                "ms": host_time_ms(
                    lambda b=body: json.dumps(
                        b, ensure_ascii=False, separators=(",", ":")
                    ).encode(),
                    args.iters,
                ),
            }
        )
        rows.append(
            {
                "step": f"{kind} body, 3 masks: orjson (now)",
                "ms": host_time_ms(lambda b=body: orjson.dumps(b), args.iters),
            }
        )
    print_table(rows, ["step", "ms"])


if __name__ == "__main__":
    main()
