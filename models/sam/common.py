"""Small layers shared by SAM's encoder and decoder (attribute names follow Meta's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.quant_linear import linear_then_residual

__all__ = ["MLP", "LayerNorm2d", "MLPBlock"]


class MLPBlock(nn.Module):
    """Two-layer feed-forward block of a transformer layer: `[..., D] -> [..., D]`."""

    def __init__(self, embedding_dim: int, mlp_dim: int, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.lin1 = nn.Linear(embedding_dim, mlp_dim)
        self.lin2 = nn.Linear(mlp_dim, embedding_dim)
        self.act = act()

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """`lin2(act(lin1(x)))`, plus `residual` if given (in lin2's epilogue where a
        quantised lin2 fuses it)."""
        return linear_then_residual(self.lin2, self.act(self.lin1(x)), residual)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of a `[B, C, H, W]` map.

    Runs `F.layer_norm` on a channels-last view: one fused kernel that accumulates in
    fp32 even for bf16 inputs, instead of a chain of mean/var element-wise ops.
    """

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)  # [B, H, W, C]
        x = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class MLP(nn.Module):
    """`num_layers` linear layers with ReLU between them (the decoder's heads)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int) -> None:
        super().__init__()
        dims_in = [input_dim] + [hidden_dim] * (num_layers - 1)
        dims_out = [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims_in, dims_out, strict=True))

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.relu(x)
        return x
