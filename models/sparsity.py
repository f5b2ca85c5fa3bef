"""2:4 structured sparsity for `nn.Linear` (moved out of models/quantize.py, which
re-exports it): prune a weight to 2 non-zeros in every 4 along the input axis (magnitude),
and on CUDA store it in cuSPARSELt's compressed form."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Sparse24Linear", "prune_2to4", "semi_structured_2to4", "sparse24_linear"]


def prune_2to4(weight: Tensor) -> Tensor:
    """Keep the 2 largest-magnitude values of every 4 consecutive inputs; zero the rest."""
    out_features, in_features = weight.shape
    if in_features % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, got {in_features}")
    groups = weight.reshape(out_features, in_features // 4, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(out_features, in_features)


@torch.library.custom_op("samserve::sparse24_linear", mutates_args=())
def sparse24_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """`x [M, K] @ W^T + b` with W 2:4-sparse and compressed by cuSPARSELt (`packed`).

    An opaque op for torch.compile: the compressed weight is a plain tensor here, which
    dynamo can trace, where torch's own sparse tensor subclass cannot be (torch 2.11).
    """
    m = x.shape[0]
    pad = -m % 16  # cuSPARSELt wants the dense operand's dimensions in multiples of 16
    dense = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = torch._cslt_sparse_mm(packed, dense.t(), bias=bias, transpose_result=True)
    return out[:m] if pad else out


@sparse24_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


class Sparse24Linear(nn.Module):
    """A Linear whose 2:4-pruned weight lives in cuSPARSELt's compressed form (CUDA only)."""

    packed: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        pruned = prune_2to4(linear.weight.detach())
        self.register_buffer("packed", torch._cslt_compress(pruned))
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = sparse24_linear(x.reshape(-1, shape[-1]), self.packed, self.bias, self.out_features)
        return y.reshape(*shape[:-1], self.out_features)


def semi_structured_2to4(
    module: nn.Module, include: Callable[[str, nn.Linear], bool], *, compress: bool
) -> list[str]:
    """Prune the accepted Linear layers to 2:4; with `compress`, store them for cuSPARSELt.

    Compression needs CUDA (fp16/bf16 weights); without it the pruned weights stay dense,
    which gives the same numbers (used by the CPU tests and as the fidelity reference).
    """
    done = []
    for name, child in list(module.named_modules()):
        for attr, layer in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if not isinstance(layer, nn.Linear) or not include(full, layer):
                continue
            if compress:
                setattr(child, attr, Sparse24Linear(layer))
            else:
                layer.weight = nn.Parameter(prune_2to4(layer.weight.detach()), requires_grad=False)
            done.append(full)
    return done
