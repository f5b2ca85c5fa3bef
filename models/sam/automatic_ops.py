"""Tensor operations behind SAM's automatic mask generation ("segment everything").

Our own torch counterparts of what Meta's `segment_anything/utils/amg.py` does with numpy,
torchvision and OpenCV: point grids and crop boxes (host-side plans, same float64
arithmetic as Meta's), the stability score, mask -> box, greedy box NMS and connected
components. Everything that touches masks runs on the masks' device; the only host syncs
are the ones each function's docstring names.
"""

from __future__ import annotations

import math
from itertools import product

import torch
from torch import Tensor

from models.images import Size

__all__ = [
    "NMS_BLOCK_PAIRS",
    "batched_nms",
    "box_iou",
    "crop_boxes",
    "is_box_near_crop_edge",
    "masks_to_boxes",
    "point_grid",
    "remove_small_regions",
    "stability_score",
]

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels (x1, y1 exclusive for crops)

# Box pairs whose IoU is computed at once while building the NMS overlap matrix.
NMS_BLOCK_PAIRS = 1 << 22
# How many propagation steps run between two convergence checks (each check is a host sync);
# the count doubles after every check so that long components cost few syncs.
_FIRST_ROUND = 4
_MAX_ROUND = 64


def point_grid(n_per_side: int) -> Tensor:
    """`[n*n, 2]` float64 (x, y) in [0, 1], x varying fastest: Meta's `build_point_grid`.

    Computed as numpy's `linspace` computes it (start + i * step, last = stop), so that
    the grid, and thus every prompt, is bit-identical to the reference's.
    """
    if n_per_side <= 0:
        return torch.zeros(0, 2, dtype=torch.float64)
    offset = 1 / (2 * n_per_side)
    start, stop = offset, 1 - offset
    step = (stop - start) / (n_per_side - 1) if n_per_side > 1 else 0.0
    side = [start + i * step for i in range(n_per_side)]
    side[-1] = stop if n_per_side > 1 else start
    coords = torch.tensor(side, dtype=torch.float64)
    xs = coords[None, :].expand(n_per_side, -1)
    ys = coords[:, None].expand(-1, n_per_side)
    return torch.stack([xs, ys], dim=-1).reshape(-1, 2)


def crop_boxes(original_size: Size, n_layers: int, overlap_ratio: float) -> list[tuple[Box, int]]:
    """(crop box, layer) pairs: the full image, then (2^i)^2 overlapping crops per layer i.

    Meta's `generate_crop_boxes`, same integer arithmetic and order (x-major per layer).
    """
    im_h, im_w = original_size
    short_side = min(im_h, im_w)
    boxes: list[tuple[Box, int]] = [((0, 0, im_w, im_h), 0)]

    def crop_len(orig_len: int, n_crops: int, overlap: int) -> int:
        return math.ceil((overlap * (n_crops - 1) + orig_len) / n_crops)

    for layer in range(n_layers):
        n_crops = 2 ** (layer + 1)
        overlap = int(overlap_ratio * short_side * (2 / n_crops))
        crop_w = crop_len(im_w, n_crops, overlap)
        crop_h = crop_len(im_h, n_crops, overlap)
        xs = [int((crop_w - overlap) * i) for i in range(n_crops)]
        ys = [int((crop_h - overlap) * i) for i in range(n_crops)]
        for x0, y0 in product(xs, ys):
            boxes.append(((x0, y0, min(x0 + crop_w, im_w), min(y0 + crop_h, im_h)), layer + 1))
    return boxes


def stability_score(logits: Tensor, mask_threshold: float, offset: float) -> Tensor:
    """IoU of the masks thresholded at `threshold +- offset`: logits `[K, H, W]` -> `[K]`.

    One mask lies inside the other, so the IoU is a ratio of pixel counts (int32 counts,
    then a float32 division, as Meta's `calculate_stability_score`; 0/0 gives NaN there too).
    """
    inner = (logits > (mask_threshold + offset)).sum(dim=(-2, -1), dtype=torch.int32)
    outer = (logits > (mask_threshold - offset)).sum(dim=(-2, -1), dtype=torch.int32)
    return inner / outer


def masks_to_boxes(masks: Tensor) -> Tensor:
    """Bool masks `[K, H, W]` -> XYXY boxes `[K, 4]` int64 with inclusive max corners.

    Meta's `batched_mask_to_box`: (min x, min y, max x, max y) of the set pixels, and
    (0, 0, 0, 0) for an empty mask.
    """
    H, W = masks.shape[-2:]
    rows = masks.any(dim=2)  # [K, H]
    cols = masks.any(dim=1)  # [K, W]
    ys = torch.arange(H, device=masks.device)
    xs = torch.arange(W, device=masks.device)
    top = torch.where(rows, ys, H).amin(dim=1)
    bottom = torch.where(rows, ys, -1).amax(dim=1)
    left = torch.where(cols, xs, W).amin(dim=1)
    right = torch.where(cols, xs, -1).amax(dim=1)
    boxes = torch.stack([left, top, right, bottom], dim=1)  # [K, 4]
    empty = ~rows.any(dim=1)  # [K]
    return torch.where(empty[:, None], torch.zeros_like(boxes), boxes)


def is_box_near_crop_edge(boxes: Tensor, crop_box: Box, original_size: Size) -> Tensor:
    """`[K]` bool: box (XYXY, original frame) within 20 px of a crop edge that is not an image edge.

    Masks cut by a crop's border are incomplete; Meta drops them (`is_box_near_crop_edge`).
    """
    h, w = original_size
    device = boxes.device
    crop = torch.tensor(crop_box, dtype=torch.float32).to(device, non_blocking=True)
    image = torch.tensor([0, 0, w, h], dtype=torch.float32).to(device, non_blocking=True)
    b = boxes.float()
    near_crop = (b - crop).abs() <= 20.0
    near_image = (b - image).abs() <= 20.0
    return (near_crop & ~near_image).any(dim=1)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """XYXY `[N, 4]`, `[M, 4]` -> IoU `[N, M]` (areas without +1, as torchvision's)."""
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2[None, :] - inter)


def batched_nms(
    boxes: Tensor,
    scores: Tensor,
    categories: Tensor | None,
    iou_threshold: float,
) -> Tensor:
    """Greedy NMS within each category: indices `[K]` int64 of kept boxes, best score first.

    Semantics of torchvision's `batched_nms` as Meta calls it: boxes (XYXY, float32) sorted
    by decreasing score (stable, so ties keep input order); a box is dropped when its IoU with
    a kept, better box of the same category is strictly above the threshold (a NaN IoU, from
    zero-area boxes, suppresses nothing). Instead of offsetting boxes per category, pairs of
    different categories are masked out of the overlap matrix.

    Greedy NMS is the unique fixed point of "keep j unless a kept i < j overlaps it", so the
    rule is iterated on the whole `[N, N]` overlap matrix (bool, built in row blocks) until
    it stops changing; the first k positions are exact after k steps, and in practice a
    handful of steps suffice. Host syncs: one per convergence check (usually one) and one
    for the final compaction.
    """
    N = boxes.shape[0]
    device = boxes.device
    if N == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    order = torch.sort(scores, descending=True, stable=True).indices  # [N]
    b = boxes[order].float()
    cat = None if categories is None else categories[order]
    later = torch.arange(N, device=device)
    over = torch.empty(N, N, dtype=torch.bool, device=device)  # over[i, j]: i suppresses j
    block = max(1, NMS_BLOCK_PAIRS // N)  # rows of float IoU temporaries at a time
    for start in range(0, N, block):
        stop = min(start + block, N)
        rows = box_iou(b[start:stop], b) > iou_threshold  # [r, N]
        rows &= later[None, :] > later[start:stop, None]
        if cat is not None:
            rows &= cat[start:stop, None] == cat[None, :]
        over[start:stop] = rows
    keep = torch.ones(N, dtype=torch.bool, device=device)
    steps = _FIRST_ROUND
    while True:
        for _ in range(steps):
            previous = keep
            keep = ~(over & keep[:, None]).any(dim=0)
        if torch.equal(keep, previous):  # host sync
            break
        steps = min(2 * steps, _MAX_ROUND)
    return order[keep]  # host sync (compaction)


def _min3x3(x: Tensor) -> Tensor:
    """Minimum over each pixel's 8-neighbourhood and itself, `[K, H, W]` (two separable passes,
    no padding: pixels outside the image do not count)."""
    row = x.clone()
    row[:, :, 1:] = torch.minimum(row[:, :, 1:], x[:, :, :-1])
    row[:, :, :-1] = torch.minimum(row[:, :, :-1], x[:, :, 1:])
    out = row.clone()
    out[:, 1:] = torch.minimum(out[:, 1:], row[:, :-1])
    out[:, :-1] = torch.minimum(out[:, :-1], row[:, 1:])
    return out


def connected_components(masks: Tensor) -> Tensor:
    """8-connected components of bool masks `[K, H, W]` -> labels `[K, H, W]` int64.

    A foreground pixel's label is the flat index (y * W + x) of its component's first pixel
    in raster order; background pixels get H * W. Every label is a pointer to a pixel of the
    same component, starting at the pixel itself. A step takes the 3x3 minimum of the labels
    (propagation), lowers the label of the pixel each label points to as well (hooking, so
    that whole trees move at once) and replaces each label by the label it points to
    (pointer jumping); labels only shrink, so the number of steps grows with the log of a
    component's extent rather than its length. A fixed point is the exact labelling:
    neighbours then share a label, and the first pixel of a component can only point to
    itself. Labels are exact integers in float32 (float64 beyond 2^24 pixels), which the
    CPU's min/max kernels handle far faster than int tensors.
    Host syncs: one per convergence check (a few; the checks get rarer as steps go on).
    """
    K, H, W = masks.shape
    HW = H * W
    dtype = torch.float32 if HW < 2**24 else torch.float64
    index = torch.arange(HW, device=masks.device, dtype=dtype).view(1, H, W)
    background = float(HW)
    # [K, HW + 1]: slot HW is the background's own pointer, so no gather needs clamping
    parent = torch.full((K, HW + 1), background, dtype=dtype, device=masks.device)
    parent[:, :HW] = torch.where(masks, index, background).view(K, HW)
    steps = _FIRST_ROUND
    while True:
        previous = parent
        for _ in range(steps):
            low = _min3x3(parent[:, :HW].view(K, H, W))
            low = torch.where(masks, low, background).view(K, HW)  # [K, HW]
            pointer = parent[:, :HW].long()
            parent = parent.scatter_reduce(1, pointer, low, reduce="amin")  # hooking
            parent[:, :HW] = torch.minimum(parent[:, :HW], low)
            parent = parent.gather(1, parent.long())  # pointer jumping
        if torch.equal(parent, previous):  # host sync
            return parent[:, :HW].long().view(K, H, W)
        steps = min(2 * steps, _MAX_ROUND)


def _component_sizes(labels: Tensor) -> Tensor:
    """Labels `[K, H, W]` -> pixel count of each label `[K, H*W + 1]` int32 (last: background)."""
    K, H, W = labels.shape
    flat = labels.view(K, H * W)
    sizes = torch.zeros(K, H * W + 1, dtype=torch.int32, device=labels.device)
    return sizes.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.int32))


def remove_small_regions(masks: Tensor, min_area: int, mode: str) -> tuple[Tensor, Tensor]:
    """Fill small holes or drop small islands: bool `[K, H, W]` -> (masks, changed `[K]`).

    Meta's `remove_small_regions` (OpenCV, 8-connectivity) on the device. "holes": background
    components (of the inverted mask) smaller than `min_area` are filled. "islands":
    foreground components smaller than `min_area` are removed, but when every component is
    small the largest one stays (ties: the first in raster order, as OpenCV numbers them).
    `changed` is True where any small region was found, as Meta reports it.
    """
    if mode not in ("holes", "islands"):
        raise ValueError(f"mode must be 'holes' or 'islands', got {mode!r}")
    K, H, W = masks.shape
    work = ~masks if mode == "holes" else masks
    labels = connected_components(work)  # [K, H, W]
    sizes = _component_sizes(labels)  # [K, HW + 1]
    pixel_size = sizes.gather(1, labels.view(K, H * W)).view(K, H, W)
    small = work & (pixel_size < min_area)  # [K, H, W]
    changed = small.flatten(1).any(dim=1)  # [K]
    if mode == "holes":
        return masks | small, changed
    large = work & ~small
    largest = sizes[:, : H * W].argmax(dim=1)  # [K] first maximal label = first in raster order
    only_largest = work & (labels == largest[:, None, None])
    has_large = large.flatten(1).any(dim=1)
    return torch.where(has_large[:, None, None], large, only_largest), changed
