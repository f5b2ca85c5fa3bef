"""Random SAM 2 weights changed to draw blobs, for the segment-everything tests.

With plain random weights every mask covers most of the image and barely depends on the
click, so a generator keeps one mask and compares nothing. These changes give flat blocks
per embedding cell (one weight for the four taps of each transposed convolution), no
per-pixel high-res skips and sharp logits: dozens of different masks per photo.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)
SHARPNESS = 100.0


def blob_weights(model: M, iou_shift: float = 0.0) -> M:
    """`model` (ours or Meta's: the same decoder names) changed in place and returned;
    `iou_shift` is added to the IoU head's logit (raising the scores past the filters)."""
    decoder: Any = model.sam_mask_decoder
    with torch.no_grad():
        for conv in (decoder.output_upscaling[0], decoder.output_upscaling[3]):
            conv.weight.copy_(conv.weight.mean(dim=(2, 3), keepdim=True).expand_as(conv.weight))
        for conv in (decoder.conv_s0, decoder.conv_s1):
            conv.weight.zero_()
            conv.bias.zero_()
        for mlp in decoder.output_hypernetworks_mlps:
            mlp.layers[-1].weight.mul_(SHARPNESS)
            mlp.layers[-1].bias.mul_(SHARPNESS)
        if iou_shift:
            decoder.iou_prediction_head.layers[-1].bias.add_(iou_shift)
    return model
