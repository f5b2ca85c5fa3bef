"""TEST-ONLY stand-in for torchvision.transforms.functional: PIL resize and to_pil_image.

Only the PIL-image paths that segment_anything uses are covered.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def to_pil_image(pic: np.ndarray | torch.Tensor, mode: str | None = None) -> Image.Image:
    """HxWxC uint8 numpy array, or CxHxW tensor, to a PIL image."""
    if isinstance(pic, torch.Tensor):
        array = pic.detach().cpu()
        if array.is_floating_point():
            array = (array * 255).to(torch.uint8)
        array = array.permute(1, 2, 0).numpy() if array.ndim == 3 else array.numpy()
    else:
        array = np.asarray(pic)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(array, mode=mode)


def resize(img: Image.Image, size: int | Sequence[int], interpolation: object = None) -> Image.Image:
    """Resize a PIL image bilinearly, as torchvision does for PIL inputs.

    size (h, w) is taken as is; an int sets the shorter side, keeping the aspect ratio.
    """
    if not isinstance(img, Image.Image):
        raise TypeError("the test stub only resizes PIL images")
    w, h = img.size
    if isinstance(size, int) or len(size) == 1:
        short = size if isinstance(size, int) else size[0]
        if w <= h:
            new_w, new_h = short, int(short * h / w)
        else:
            new_w, new_h = int(short * w / h), short
    else:
        new_h, new_w = int(size[0]), int(size[1])
    if (new_w, new_h) == (w, h):
        return img
    return img.resize((new_w, new_h), Image.BILINEAR)
