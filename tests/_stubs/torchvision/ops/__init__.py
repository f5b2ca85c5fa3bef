"""TEST-ONLY stand-in for torchvision.ops (see tests/_stubs/README.md)."""

from .boxes import batched_nms, box_area, box_iou, nms

__all__ = ["batched_nms", "box_area", "box_iou", "nms"]
