"""TEST-ONLY stand-in for torchvision.transforms (see tests/_stubs/README.md).

`ToTensor`, `Resize` and `Normalize` cover the tensor paths Meta's `sam2` package uses
(`SAM2Transforms`: ToTensor on an HWC uint8 array, then a TorchScript-ed Resize to a fixed
(h, w) and Normalize). Resize is bilinear with antialiasing, torchvision's default for
tensors since 0.17; both modules are scriptable because Meta scripts them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ToTensor:
    """HWC uint8 array -> CHW float tensor in [0, 1]."""

    def __call__(self, pic: np.ndarray) -> Tensor:
        if not isinstance(pic, np.ndarray) or pic.ndim != 3 or pic.dtype != np.uint8:
            raise TypeError("the test stub's ToTensor takes HWC uint8 arrays only")
        return torch.from_numpy(np.array(pic)).permute(2, 0, 1).float() / 255.0


class Resize(nn.Module):
    """Resize a CHW (or BCHW) float tensor to exactly (h, w), bilinear with antialiasing."""

    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        if isinstance(size, int) or len(size) != 2:
            raise TypeError("the test stub's Resize takes an (h, w) pair only")
        self.size = [int(size[0]), int(size[1])]

    def forward(self, x: Tensor) -> Tensor:
        batched = x.dim() == 4
        y = x if batched else x.unsqueeze(0)
        y = F.interpolate(y, size=self.size, mode="bilinear", align_corners=False, antialias=True)
        return y if batched else y.squeeze(0)


class Normalize(nn.Module):
    """(x - mean) / std per channel of a CHW (or BCHW) tensor."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean = [float(m) for m in mean]
        self.std = [float(s) for s in std]

    def forward(self, x: Tensor) -> Tensor:
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
        return (x - mean) / std
