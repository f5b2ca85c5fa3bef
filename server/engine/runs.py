"""COCO runs of a batch of masks, found on the device (`server.rle` says why).

Only the run boundaries, areas and boxes cross to the host, in one copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models.images import upload
from server.rle import MaskRuns

__all__ = ["mask_runs"]


def _boxes(masks: Tensor) -> Tensor:
    """XYWH boxes `[K, 4]` of bool masks `[K, H, W]` (all zeros for an empty mask)."""
    _, H, W = masks.shape
    rows, cols = masks.any(dim=2), masks.any(dim=1)  # [K, H], [K, W]
    ys = torch.arange(H, device=masks.device)
    xs = torch.arange(W, device=masks.device)
    y0 = torch.where(rows, ys, H).amin(dim=1)
    y1 = torch.where(rows, ys, -1).amax(dim=1)
    x0 = torch.where(cols, xs, W).amin(dim=1)
    x1 = torch.where(cols, xs, -1).amax(dim=1)
    empty = ~rows.any(dim=1)
    box = torch.stack([x0, y0, x1 - x0 + 1, y1 - y0 + 1], dim=1)
    return torch.where(empty[:, None], torch.zeros_like(box), box)


def mask_runs(stacks: list[Tensor]) -> list[MaskRuns]:
    """bool masks, one `[K, H, W]` stack per image (any sizes, one device) -> COCO runs.

    All stacks are flattened column-major into one vector, so the whole batch needs one
    `nonzero` and one copy back, however many images and masks it holds.
    """
    if not stacks:
        return []
    device = stacks[0].device
    flats = [m.transpose(1, 2).reshape(-1) for m in stacks]  # column-major, as COCO
    lengths = [m.shape[1] * m.shape[2] for m in stacks]
    counts_per = [m.shape[0] for m in stacks]
    flat = torch.cat(flats)
    # every mask's start in `flat`, known on the host
    per_mask = np.repeat(np.asarray(lengths, dtype=np.int64), counts_per)
    starts = np.concatenate([[0], np.cumsum(per_mask)])[:-1].astype(np.int64)
    change = (flat[1:] != flat[:-1]).nonzero().squeeze(1)  # positions before a change
    first = flat[upload(torch.from_numpy(starts), device)]  # no sync
    areas = torch.cat([m.flatten(1).sum(dim=1) for m in stacks])
    boxes = torch.cat([_boxes(m) for m in stacks])
    # one copy back for the whole batch
    packed = torch.cat([change, first.long(), areas.long(), boxes.long().reshape(-1)]).cpu()
    host = packed.numpy()
    m = change.shape[0]
    total = starts.shape[0]
    positions = host[:m] + 1  # the index where a new run starts
    first_np = host[m : m + total].astype(bool)
    areas_np = host[m + total : m + 2 * total]
    boxes_np = host[m + 2 * total :].reshape(total, 4).astype(np.float64)
    out: list[MaskRuns] = []
    k = 0
    for stack, n in zip(stacks, lengths, strict=True):
        runs_of_stack = []
        for _ in range(stack.shape[0]):
            lo, hi = starts[k], starts[k] + n
            inside = positions[
                np.searchsorted(positions, lo, side="right") : np.searchsorted(
                    positions, hi, side="left"
                )
            ]
            edges = np.concatenate(([0], inside - lo, [n]))
            runs = np.diff(edges)
            if first_np[k]:  # COCO counts start with a (here empty) run of zeros
                runs = np.concatenate(([0], runs))
            runs_of_stack.append(runs)
            k += 1
        first_k = k - stack.shape[0]
        out.append(
            MaskRuns(
                (int(stack.shape[1]), int(stack.shape[2])),
                runs_of_stack,
                areas_np[first_k:k].astype(np.int64),
                boxes_np[first_k:k],
            )
        )
    return out
