"""The MLP's hidden activation handed from its first Linear to its second quantised (issue 20).

Why: in a quantised MLP `fc2(gelu(fc1(x)))` the hidden activation is 4x the block's width.
Written in bf16 by fc1 and quantised again for fc2, it crosses memory three times (bf16
out, bf16 in, int8 out) before fc2 reads it once more. Here fc1's epilogue writes it
quantised (int8 or e4m3, 1 byte a value) and fc2 reads that directly.

Per tile, not per row: a row's scale needs the row's absmax, and fc1's row (384 to 3072
values) spans several output tiles, which no tile sees whole. So each tile quantises its
own part: one fp32 scale per row and `HOP_GROUP` (128) columns (`[M, N / 128]`), and fc2
multiplies each 128-column block's partial product by its scales before summing (its
BLOCK_K divides 128). Finer scales than per row: less rounding error, not more (a GELU
output's outliers spoil only their own group). The cost is in fc2's loop: each block's
product is scaled into an fp32 sum instead of accumulating in the tensor cores' registers
(bench/int8_gemm.py `hop` columns measure whether it pays).

Between the two Linears the pair `(values [..., N], scales [..., N / 128])` passes through
the MLP's `act` (an `nn.Identity` once GELU is fused into fc1): `fuse_mlp_hop` sets the
first Linear's `hop_out`; the second takes a pair wherever it gets one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from models.fp8_gemm import FP8, fp8_linear_reference, fp8_supported, quantize_rows_fp8
from models.gemm_persistent import (
    launch_persistent,
    launch_persistent_quant_out,
    persistent_for,
    served_config,
)
from models.int8_gemm import (
    HOP_GROUP,
    epilogue_reference,
    fused_supported,
    int8_linear_reference,
    launch,
    launch_quant_out,
    quantize_rows,
)
from models.ln_quant import unpack_rows

__all__ = [
    "HOP_GROUP",
    "fuse_mlp_hop",
    "linear_from_groups",
    "linear_from_groups_reference",
    "linear_to_groups",
    "linear_to_groups_reference",
    "mlp_pairs",
    "mlp_second_layers",
    "quantize_groups",
]


def _kernel_runs(weight: Tensor) -> bool:
    fp8 = weight.dtype == FP8
    return fp8_supported(weight.device) if fp8 else fused_supported(weight.device)


def quantize_groups(y: Tensor, fp8: bool) -> tuple[Tensor, Tensor]:
    """`y [M, N]` -> (`[M, N]` int8 / e4m3, `[M, N / 128]` fp32): one scale per row and
    group of 128 columns, as the epilogue quantises its tiles."""
    m, n = y.shape
    groups = y.float().reshape(m * (n // HOP_GROUP), HOP_GROUP)
    q, scale = quantize_rows_fp8(groups) if fp8 else quantize_rows(groups)
    return q.reshape(m, n), scale.reshape(m, n // HOP_GROUP)


def linear_to_groups_reference(
    xq: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None, gelu: bool
) -> tuple[Tensor, Tensor]:
    """The first Linear in torch: its fp32 result (the kernel's arithmetic), quantised."""
    fp8 = weight.dtype == FP8
    reference = fp8_linear_reference if fp8 else int8_linear_reference
    y = reference(xq, x_scale, weight, w_scale, bias, None, gelu, torch.float32)
    return quantize_groups(y, fp8)


def linear_from_groups_reference(
    q: Tensor,
    group_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """The second Linear in torch: each group's product (exact in fp32 for int8: at most
    128 x 127^2 < 2^24) times its scales, summed in fp32; then the epilogue."""
    m, k = q.shape
    qf, wf = q.float(), weight.float()
    acc = torch.zeros(m, weight.shape[0], device=q.device)
    for g in range(k // HOP_GROUP):
        cols = slice(g * HOP_GROUP, (g + 1) * HOP_GROUP)
        acc += (qf[:, cols] @ wf[:, cols].t()) * group_scale[:, g : g + 1].float()
    ones = torch.ones(m, device=q.device)
    return epilogue_reference(acc, ones, w_scale, bias, residual, False, out_dtype)


@torch.library.custom_op("serve::linear_to_groups", mutates_args=())
def linear_to_groups(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    gelu: bool,
) -> tuple[Tensor, Tensor]:
    """`gelu?(x W^T + b)` quantised in groups of 128 columns: (`[M, N]` values of
    `weight`'s dtype, `[M, N / 128]` fp32 scales). `x [M, K]` is quantised like `weight`
    with one scale a row (`x_scale [M]`), or packed rows from a `QuantizingLayerNorm`
    (`x_scale` None). The Triton kernel where it runs, the torch reference elsewhere."""
    if x_scale is None:
        x, x_scale = unpack_rows(x, weight.dtype == FP8)
    if _kernel_runs(weight):
        if persistent_for(x, weight):  # Hopper, SAM-sized products
            config = served_config(False, quant_out=True)
            return launch_persistent_quant_out(x, x_scale, weight, w_scale, bias, gelu=gelu,
                                               gelu_tanh=gelu, config=config)  # fmt: skip
        return launch_quant_out(x, x_scale, weight, w_scale, bias, gelu=gelu)
    return linear_to_groups_reference(x, x_scale, weight, w_scale, bias, gelu)


@linear_to_groups.register_fake
def _(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    gelu: bool,
) -> tuple[Tensor, Tensor]:
    m, n = x.shape[0], weight.shape[0]
    scales = x.new_empty((m, n // HOP_GROUP), dtype=torch.float32)
    return x.new_empty((m, n), dtype=weight.dtype), scales


@torch.library.custom_op("serve::linear_from_groups", mutates_args=())
def linear_from_groups(
    q: Tensor,
    group_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """`q` (`[M, K]`, scales per row and 128 columns, from `linear_to_groups`) times
    `weight^T`, + bias + residual, as `out_dtype`."""
    if _kernel_runs(weight):
        if persistent_for(q, weight):
            return launch_persistent(q, group_scale, weight, w_scale, bias, residual,
                                     out_dtype=out_dtype, group_k=HOP_GROUP,
                                     config=served_config(residual is not None))  # fmt: skip
        return launch(q, group_scale, weight, w_scale, bias, residual, out_dtype=out_dtype,
                      group_k=HOP_GROUP)  # fmt: skip
    return linear_from_groups_reference(q, group_scale, weight, w_scale, bias, residual, out_dtype)


@linear_from_groups.register_fake
def _(
    q: Tensor,
    group_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


def _mlp_pairs() -> dict[type, tuple[str, str]]:
    from models.sam.common import MLPBlock
    from models.swin.model import Mlp

    return {Mlp: ("fc1", "fc2"), MLPBlock: ("lin1", "lin2")}


def mlp_pairs(module: nn.Module) -> Iterator[tuple[str, nn.Module, tuple[str, str]]]:
    """(name, the MLP, (its first Linear's attribute, its second's)) for each of Swin's
    `Mlp` and SAM's `MLPBlock` in `module`."""
    pairs = _mlp_pairs()
    for name, child in module.named_modules():
        attrs = pairs.get(type(child))
        if attrs is not None:
            yield name, child, attrs


def mlp_second_layers(module: nn.Module) -> frozenset[str]:
    """The names of the MLPs' second Linears whose input could come in groups (hidden width
    a multiple of 128): what the per-layer choice measures so (`measure_int8(grouped=)`)."""
    names = set()
    for name, child, (_, attr) in mlp_pairs(module):
        second = getattr(child, attr)
        if isinstance(second, nn.Linear) and second.in_features % HOP_GROUP == 0:
            names.add(f"{name}.{attr}" if name else attr)
    return frozenset(names)


def fuse_mlp_hop(module: nn.Module) -> list[str]:
    """Hand the hidden activation of Swin's `Mlp` and SAM's `MLPBlock` quantised from the
    first Linear to the second where both are quantised alike by the fused kernel, GELU is
    in the first's epilogue (`fuse_gelu`) and the hidden width is a multiple of 128.
    Returns the first Linears' names."""
    from models.quantize import DynamicQuantLinear

    fused = []
    for name, child, names in mlp_pairs(module):
        first, second = (getattr(child, n) for n in names)
        if (
            isinstance(first, DynamicQuantLinear)
            and isinstance(second, DynamicQuantLinear)
            and first.kind == second.kind
            and first.kernel == second.kernel == "fused"
            and first.gelu
            and isinstance(child.act, nn.Identity)
            and first.out_features % HOP_GROUP == 0
            and getattr(second, "input_inv_scale", None) is None
        ):
            first.hop_out = True
            fused.append(f"{name}.{names[0]}" if name else names[0])
    return fused
