"""The checkable task that synthetic SAM weights learn: prompts name simple shapes.

No trained SAM checkpoint can be downloaded here, and seeded random weights give masks of
noise. Synthetic weights (`models.sam.synthesize`) are trained so that a prompt names a
shape anyone can check, whatever the image holds:

- a box -> the box's region with rounded corners (corner radius a quarter of its shorter
  side);
- a foreground point -> a disc around it, radius `DISC_FRACTION` of the model input size
  (1/8 of the image's longest side);
- a background point -> that disc cut out of whatever the other prompts name;
- points alone: foreground discs minus background discs;
- a box with points: the box names the object, so the mask stays inside the box. A
  foreground point adds nothing beyond it (it confirms the box's object); a background
  point cuts a hole, its radius capped at `HOLE_FRACTION` of the box's shorter side, so a
  hole never erases a small box (uncapped, 0.5% of sampled box + background prompts named
  an empty mask, 3% less than a fifth of the box: held-out IoU 0 on such prompts).

The three multimask outputs draw the same shapes at `MULTIMASK_SIZES` (smaller, same,
larger): three nested guesses. Every output's predicted IoU is trained against its IoU
with the size-1 shape, the object the prompt names, so the score of any returned mask
estimates that mask's quality and sorting by score puts the size-1 output first.

Coordinates are those of the model input frame (pixel indexes, as `scale_coords` gives);
every shape is a pure function of the prompt, evaluated on any grid of such coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.sam.prompts import PromptSet

__all__ = [
    "CORNER_FRACTION",
    "DISC_FRACTION",
    "HOLE_FRACTION",
    "KINDS",
    "MULTIMASK_SIZES",
    "ShapePrompts",
    "low_res_grid",
    "sample_prompts",
    "shape_masks",
]

DISC_FRACTION = 1 / 8  # disc radius / model input size
CORNER_FRACTION = 1 / 4  # corner radius / the box's shorter side
HOLE_FRACTION = 1 / 4  # most a background hole's radius may be / a box's shorter side
MULTIMASK_SIZES = (0.5, 1.0, 1.5)  # the sizes drawn by mask tokens 1, 2, 3 (token 0: 1.0)
KINDS = ("box", "point", "pair", "box_point")
MAX_POINTS = 2


@dataclass(frozen=True)
class ShapePrompts:
    """P prompts, padded: boxes `[P, 4]` (x0, y0, x1, y1) valid where has_box `[P]`;
    points `[P, K, 2]` (x, y) with labels `[P, K]` (1 foreground, 0 background, -1 none);
    kind `[P]` indexes `KINDS`. Model input frame, float32, on one device."""

    boxes: Tensor
    has_box: Tensor
    points: Tensor
    labels: Tensor
    kind: Tensor

    def __len__(self) -> int:
        return int(self.boxes.shape[0])

    def prompt_sets(self) -> list[PromptSet]:
        """The same prompts as the service packs them (absent points left out)."""
        boxes, has_box = self.boxes.cpu().numpy(), self.has_box.cpu().numpy()
        points, labels = self.points.cpu().numpy(), self.labels.cpu().numpy()
        sets = []
        for p in range(len(self)):
            keep = labels[p] >= 0
            sets.append(
                PromptSet(
                    points=points[p][keep],
                    labels=labels[p][keep].astype(np.int64),
                    box=boxes[p] if has_box[p] else None,
                )
            )
        return sets

    def without_last_point(self) -> ShapePrompts:
        """The prompt one click earlier (its last point removed where it has a box or two
        points; a lone point or box stays): what the previous mask of a refinement showed."""
        labels = self.labels.clone()
        present = labels >= 0
        count = present.sum(1)
        drop = (count >= 2) | (self.has_box & (count >= 1))
        last = (count - 1).clamp(min=0)
        rows = torch.arange(len(self), device=labels.device)
        labels[rows[drop], last[drop]] = -1
        return ShapePrompts(self.boxes, self.has_box, self.points, labels, self.kind)


def shape_masks(
    prompts: ShapePrompts, xs: Tensor, ys: Tensor, image_size: int, sizes: Sequence[float]
) -> Tensor:
    """What each prompt names, drawn at each size: bool `[P, len(sizes), len(ys), len(xs)]`.

    xs `[W]`, ys `[H]`: the model-input-frame coordinates of the grid's columns and rows.
    """
    scale = torch.tensor(list(sizes), device=xs.device, dtype=torch.float32).view(1, -1, 1, 1)
    x = xs.float().view(1, 1, 1, -1)
    y = ys.float().view(1, 1, -1, 1)
    b = prompts.boxes.float()
    cx, cy = (
        ((b[:, 0] + b[:, 2]) / 2).view(-1, 1, 1, 1),
        ((b[:, 1] + b[:, 3]) / 2).view(-1, 1, 1, 1),
    )
    hw = ((b[:, 2] - b[:, 0]).abs() / 2).view(-1, 1, 1, 1) * scale  # [P, S, 1, 1]
    hh = ((b[:, 3] - b[:, 1]).abs() / 2).view(-1, 1, 1, 1) * scale
    corner = 2 * CORNER_FRACTION * torch.minimum(hw, hh)
    dx = ((x - cx).abs() - (hw - corner)).clamp(min=0)
    dy = ((y - cy).abs() - (hh - corner)).clamp(min=0)
    boxed = prompts.has_box.view(-1, 1, 1, 1)
    inside = (dx.square() + dy.square() <= corner.square()) & boxed
    radius = DISC_FRACTION * image_size * scale  # [1, S, 1, 1]
    hole = torch.where(
        boxed, torch.minimum(radius, 2 * HOLE_FRACTION * torch.minimum(hw, hh)), radius
    )
    for k in range(prompts.points.shape[1]):
        px = prompts.points[:, k, 0].float().view(-1, 1, 1, 1)
        py = prompts.points[:, k, 1].float().view(-1, 1, 1, 1)
        d2 = (x - px).square() + (y - py).square()
        label = prompts.labels[:, k].view(-1, 1, 1, 1)
        adds = (d2 <= radius.square()) & (label == 1) & ~boxed
        inside = (inside | adds) & ~((d2 <= hole.square()) & (label == 0))
    return inside


def low_res_grid(
    image_size: int, mask_size: int, device: torch.device, supersample: int = 1
) -> tuple[Tensor, Tensor]:
    """Input-frame coordinates of the low-res mask grid's pixel centres (with `supersample`
    sub-pixels per side: `[mask_size * supersample]` each); x and y are the same."""
    n = mask_size * supersample
    step = image_size / n
    coords = (torch.arange(n, device=device, dtype=torch.float32) + 0.5) * step - 0.5
    return coords, coords


def sample_prompts(
    n: int,
    input_sizes: Tensor,
    image_size: int,
    generator: torch.Generator,
    kinds: Sequence[int] | None = None,
) -> ShapePrompts:
    """`n` random prompts inside the valid part of each image (on the CPU).

    input_sizes `[n, 2]`: (newh, neww) of the image each prompt is for. kinds: the index
    in `KINDS` of each prompt, or None for an even mix.
    """
    g = generator

    def uniform(lo: Tensor | float, hi: Tensor | float) -> Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=g)

    h, w = input_sizes[:, 0].float(), input_sizes[:, 1].float()
    kind = (
        torch.randint(0, len(KINDS), (n,), generator=g)
        if kinds is None
        else torch.as_tensor(list(kinds), dtype=torch.int64)
    )
    bw, bh = uniform(0.12, 0.9) * w, uniform(0.12, 0.9) * h
    x0, y0 = uniform(0, 1) * (w - bw), uniform(0, 1) * (h - bh)
    boxes = torch.stack([x0, y0, x0 + bw, y0 + bh], dim=1)
    has_box = (kind == KINDS.index("box")) | (kind == KINDS.index("box_point"))

    anywhere = torch.stack([uniform(0, 1) * (w - 1), uniform(0, 1) * (h - 1)], dim=1)
    in_box = torch.stack([uniform(x0, x0 + bw), uniform(y0, y0 + bh)], dim=1)
    first = torch.where((kind == KINDS.index("box_point"))[:, None], in_box, anywhere)
    angle = uniform(0, 2 * torch.pi)
    reach = uniform(0.3, 1.8) * DISC_FRACTION * image_size
    second = first + reach[:, None] * torch.stack([angle.cos(), angle.sin()], dim=1)
    second = torch.minimum(second.clamp(min=0), torch.stack([w - 1, h - 1], dim=1))
    points = torch.stack([first, second], dim=1)  # [n, 2, 2]

    labels = torch.full((n, MAX_POINTS), -1, dtype=torch.int64)
    labels[:, 0] = torch.where(kind == KINDS.index("box"), -1, 1)
    box_point = kind == KINDS.index("box_point")
    labels[box_point, 0] = torch.randint(0, 2, (int(box_point.sum()),), generator=g)
    labels[kind == KINDS.index("pair"), 1] = 0
    return ShapePrompts(boxes, has_box, points, labels, kind)
