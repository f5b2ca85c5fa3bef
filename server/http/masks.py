"""Binary masks -> the JSON mask objects of the contract (runs in the decode thread pool).

`rle` (default) is COCO compressed RLE, decodable with `pycocotools.mask.decode`; `png` is a
base64 1-bit PNG; `polygons` are the outer boundaries of each connected region, as COCO
polygons `[x0, y0, x1, y1, ...]` on pixel corners. Area and bbox come from the RLE, so every
output form reports the same numbers.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

from server.rle import MaskRuns

__all__ = ["build_mask_objects", "encode_rle", "mask_polygons"]


def encode_rle(masks: np.ndarray) -> list[dict[str, Any]]:
    """bool `[K, H, W]` -> K COCO RLEs with `counts` as text."""
    if masks.shape[0] == 0:
        return []
    fortran = np.asfortranarray(masks.transpose(1, 2, 0).astype(np.uint8))  # [H, W, K]
    rles = mask_utils.encode(fortran)
    return list(rles)


def _png(mask: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(mask).convert("1").save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def mask_polygons(mask: np.ndarray) -> list[list[float]]:
    """Outer boundaries of a bool `[H, W]` mask, one closed polygon per region.

    Boundary edges between an inside and an outside pixel are directed so the inside lies
    on their right, then chained into loops; loops that turn clockwise on screen (positive
    shoelace area in y-down coordinates) are outer boundaries, the others are holes and
    are left out. Collinear vertices are dropped, so a rectangle is four points.
    """
    m = np.pad(mask.astype(bool), 1)
    # Horizontal edges: between rows r-1 and r (in padded coordinates), at y = r - 1.
    top = m[1:, :] & ~m[:-1, :]  # inside below, outside above: edge runs left -> right
    bottom = m[:-1, :] & ~m[1:, :]  # inside above: right -> left
    left = m[:, 1:] & ~m[:, :-1]  # inside to the right of the edge: bottom -> top
    right = m[:, :-1] & ~m[:, 1:]  # inside to the left: top -> bottom
    nxt: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def add(starts: np.ndarray, dx: int, dy: int, ox: int, oy: int) -> None:
        for r, c in zip(*np.nonzero(starts), strict=True):
            a = (int(c) + ox - 1, int(r) + oy - 1)
            nxt.setdefault(a, []).append((a[0] + dx, a[1] + dy))

    add(top, 1, 0, 0, 1)  # pixel (r, c-1)'s top edge from corner (c-1, r) rightwards
    add(bottom, -1, 0, 1, 1)
    add(left, 0, -1, 1, 1)
    add(right, 0, 1, 1, 0)
    polygons: list[list[float]] = []
    while nxt:
        start = next(iter(nxt))
        loop = [start]
        prev_dir: tuple[int, int] | None = None
        point = start
        while True:
            choices = nxt[point]
            if len(choices) > 1 and prev_dir is not None:
                # Two regions touch at a corner: turn right, which keeps them apart.
                right_turn = (-prev_dir[1], prev_dir[0])
                pick = next(
                    (q for q in choices if (q[0] - point[0], q[1] - point[1]) == right_turn),
                    choices[0],
                )
            else:
                pick = choices[0]
            choices.remove(pick)
            if not choices:
                del nxt[point]
            prev_dir = (pick[0] - point[0], pick[1] - point[1])
            point = pick
            if point == start:
                break
            loop.append(point)
        pts = np.asarray(loop, dtype=np.float64)
        area2 = float(
            np.sum(pts[:, 0] * np.roll(pts[:, 1], -1) - np.roll(pts[:, 0], -1) * pts[:, 1])
        )
        if area2 <= 0:  # a hole (or degenerate)
            continue
        polygons.append(_simplify(loop))
    return polygons


def _simplify(loop: list[tuple[int, int]]) -> list[float]:
    """Drop vertices that lie on a straight run; flatten to [x0, y0, x1, y1, ...]."""
    n = len(loop)
    kept = []
    for i in range(n):
        (ax, ay), (bx, by), (cx, cy) = loop[i - 1], loop[i], loop[(i + 1) % n]
        if (bx - ax) * (cy - by) - (by - ay) * (cx - bx) != 0:
            kept.append((bx, by))
    return [float(v) for p in kept for v in p]


def build_mask_objects(
    scores: np.ndarray,
    output: str,
    masks: np.ndarray | None = None,
    runs: MaskRuns | None = None,
) -> list[dict[str, Any]]:
    """Scores `[K]` and either bool masks `[K, H, W]` or their device-made runs -> the
    `masks` list of one result. Runs serve `rle` without touching a full mask on the host."""
    if runs is not None and output == "rle":
        size = [runs.size[0], runs.size[1]]
        return [
            {
                "segmentation": {"size": size, "counts": runs.string(k)},
                "score": float(scores[k]),
                "area": int(runs.areas[k]),
                "bbox": [float(v) for v in runs.boxes[k]],
            }
            for k in range(len(runs))
        ]
    if masks is None:
        raise ValueError(f"output {output!r} needs the masks themselves")
    rles = encode_rle(masks)
    areas = mask_utils.area(rles) if rles else []
    boxes = mask_utils.toBbox(rles) if rles else []
    height, width = int(masks.shape[1]), int(masks.shape[2])
    objects = []
    for k, rle in enumerate(rles):
        size = [height, width]
        if output == "rle":
            segmentation: dict[str, Any] = {"size": size, "counts": rle["counts"].decode("ascii")}
        elif output == "png":
            segmentation = {"size": size, "png": _png(masks[k])}
        elif output == "polygons":
            segmentation = {"size": size, "polygons": mask_polygons(masks[k])}
        else:
            raise ValueError(f"unknown output {output!r}")
        objects.append(
            {
                "segmentation": segmentation,
                "score": float(scores[k]),
                "area": int(areas[k]),
                "bbox": [float(v) for v in boxes[k]],
            }
        )
    return objects
