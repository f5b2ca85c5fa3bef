"""What the served masks look like with a given checkpoint: response size, score, and how
well the mask covers the box it was asked for, per real photo, through the HTTP API.

Random weights give masks of noise (responses of 60-200 KB, negative scores); synthetic
weights (`python -m models.weights synthesize`) should give a rounded box: a response of a
few KB, a score in [0, 1], and a mask that fills most of its box and little outside it.

    python -m bench.synthetic_check --url http://127.0.0.1:8765 --images .benchdata/images
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np

from bench.common import DEFAULT_IMAGES, print_table
from server.client import Client


def central_box(width: int, height: int) -> list[float]:
    """The middle half of the photo in each direction."""
    return [width / 4, height / 4, 3 * width / 4, 3 * height / 4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    args = p.parse_args()
    rows = []
    with Client(args.url, timeout=120) as client:
        for path in sorted(args.images.glob("*.jpg")):
            data = path.read_bytes()
            embedded = client.embed(data)
            width, height = embedded.width, embedded.height
            box = central_box(width, height)
            body = {"image_id": embedded.image_id, "box": box}
            raw = httpx.post(f"{args.url}/v1/segment", json=body, timeout=120)
            raw.raise_for_status()
            reply = raw.json()
            segmentation = client.segment(image_id=embedded.image_id, box=box)
            mask = segmentation.results[0][0].mask  # [H, W] bool
            inside = np.zeros_like(mask)
            x0, y0, x1, y1 = (round(v) for v in box)
            inside[y0:y1, x0:x1] = True
            covered = float((mask & inside).sum() / inside.sum())
            outside = float((mask & ~inside).sum() / max(1, mask.sum()))
            rows.append(
                {
                    "photo": path.name,
                    "size": f"{width}x{height}",
                    "response_bytes": len(raw.content),
                    "score": round(reply["results"][0]["masks"][0]["score"], 3),
                    "box_covered": round(covered, 3),
                    "mask_outside_box": round(outside, 3),
                    "weights": reply["model"]["weights"],
                }
            )
    print_table(rows, list(rows[0]))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
