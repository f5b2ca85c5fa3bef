"""TEST-ONLY stand-in for torchvision.ops.boxes: NMS and box areas in plain torch.

Semantics follow torchvision: boxes are (x1, y1, x2, y2) with no +1 in areas; a box is
suppressed when its IoU with a kept, higher-scoring box is strictly greater than the
threshold; the kept indices come back sorted by decreasing score (stable for ties).
"""

from __future__ import annotations

import torch
from torch import Tensor


def box_area(boxes: Tensor) -> Tensor:
    """[N, 4] -> [N] areas."""
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """[N, 4], [M, 4] -> [N, M] IoU."""
    area1, area2 = box_area(boxes1), box_area(boxes2)
    lt = torch.max(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2[None, :] - inter)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS; int64 indices of kept boxes, by decreasing score."""
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    iou = box_iou(boxes[order], boxes[order]).cpu()
    suppressed = torch.zeros(order.numel(), dtype=torch.bool)
    keep: list[int] = []
    for i in range(order.numel()):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= iou[i] > iou_threshold
    return order[torch.tensor(keep, dtype=torch.int64, device=order.device)]


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """NMS within each category `idxs`; indices by decreasing score, as torchvision's.

    Like torchvision, small inputs shift each category into its own coordinate region (one
    NMS call), large ones run one NMS per category.
    """
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    if boxes.numel() <= (4000 if boxes.device.type == "cpu" else 20000):
        offsets = idxs.to(boxes) * (boxes.max() + torch.tensor(1).to(boxes))
        return nms(boxes + offsets[:, None], scores, iou_threshold)
    keep_mask = torch.zeros_like(scores, dtype=torch.bool)
    for category in torch.unique(idxs):
        members = torch.where(idxs == category)[0]
        keep_mask[members[nms(boxes[members], scores[members], iou_threshold)]] = True
    keep = torch.where(keep_mask)[0]
    return keep[torch.sort(scores[keep], descending=True, stable=True).indices]
