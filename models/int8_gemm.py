"""int8 x int8 GEMM with the dequantisation, bias, GELU and residual in its epilogue (Triton).

Why a kernel of our own: through `torch._int_mm` an int8 Linear is three trips through
memory, the product written as int32 (4 bytes per output), read back to dequantise
(`x_scale[row] * w_scale[col]`), add the bias and cast. On an H100 that made every Swin-T
product but one slower than bf16's (`python -m bench.int8_probe`, docs/BENCHMARKS.md): at
Swin's first stage (K = 96) the int32 output alone is four times the int8 input. Here the
int32 accumulator never leaves the registers: each output tile is scaled, biased, optionally
passed through GELU (exact erf, as `nn.GELU()`) and added to a residual, then stored once
in the activation's dtype (bf16 / fp16 / fp32).

Operands, in the layout the kernel wants (int8 tensor cores take both K-major):
- `xq` `[M, K]` int8 row-major (a column-major one is copied first) and `x_scale` `[M]` fp32:
  the activation quantised per token (`quantize_rows`; under torch.compile inductor fuses
  that into the kernel of the op before, usually the LayerNorm);
- `weight` `[N, K]` int8 contiguous (per output channel) and `w_scale` `[N]` fp32, prepared
  once at load time (`models.quantize.Int8DynamicLinear`).

`int8_linear` is a torch custom op (opaque to torch.compile, captured by CUDA graphs). On
CUDA with Triton it runs the kernel; elsewhere (the CPU: tests, CPU serving) it runs the
same arithmetic in torch, `torch._int_mm` then the epilogue in fp32, in the same order.
The kernel itself (models/gemm_kernel.py, re-exported here) also takes e4m3 operands
(`models.fp8_gemm`), inputs scaled per 128 columns and writes outputs quantised that way
(`models.mlp_hop`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from models.gemm_kernel import (
    DEFAULT_CONFIG,
    HOP_CONFIGS,
    HOP_GROUP,
    HOPPER_CONFIGS,
    GemmConfig,
    launch,
    launch_quant_out,
)
from models.gemm_persistent import launch_persistent, persistent_for, served_config

__all__ = [
    "DEFAULT_CONFIG",
    "HOPPER_CONFIGS",
    "HOP_CONFIGS",
    "HOP_GROUP",
    "GemmConfig",
    "epilogue_reference",
    "fused_supported",
    "int8_linear",
    "int8_linear_reference",
    "launch",
    "launch_quant_out",
    "quantize_rows",
    "triton_gemm_available",
]

_EPS = 1e-12
_SQRT_HALF = 1.0 / math.sqrt(2.0)


@functools.cache
def triton_gemm_available() -> bool:
    """Triton imports here (CUDA builds of torch bring it; the CPU tests install it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def fused_supported(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA with Triton, and int8 tensor cores of the
    kind Triton generates for (compute capability 8.0 on: Ampere, Ada, Hopper). Elsewhere
    `int8_linear` runs its torch reference (`torch._int_mm`)."""
    if device.type != "cuda" or not triton_gemm_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """`x [M, K]` float -> (`[M, K]` int8, `[M]` fp32 scales): one scale per token (row),
    its absmax over 127. Plain torch ops, so inductor fuses them into the op before."""
    x = x.float()
    scale = x.abs().amax(dim=1).clamp(min=_EPS) / 127.0
    q = torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_linear_reference(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """The kernel's arithmetic in torch: the int32 product, then the epilogue in fp32."""
    acc = torch._int_mm(xq.contiguous(), weight.t())  # [M, N] int32
    return epilogue_reference(acc.float(), x_scale, w_scale, bias, residual, gelu, out_dtype)


def epilogue_reference(
    acc: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """The kernel's epilogue in torch, on the fp32 product `acc [M, N]` (int8's and fp8's)."""
    y = acc * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    if gelu:
        y = 0.5 * y * (1.0 + torch.erf(y * _SQRT_HALF))
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype)


def define_linear_op(
    name: str, supported: Callable[[torch.device], bool], reference: Callable[..., Tensor]
) -> Callable[..., Tensor]:
    """The `serve::<name>` op of one operand format (int8 here, e4m3 in models.fp8_gemm):
    `gelu?(xq x_scale (weight w_scale)^T + bias) + residual` as `out_dtype` `[M, N]`, the
    Triton kernel where `supported`, `reference` elsewhere (the same numbers up to the
    erf's last bits and fused multiply-adds; on Hopper, int8 products from K and N of 768
    on take models.gemm_persistent, whose GELU is the tanh form, within about 3e-4 of the
    exact one). An op of its own, opaque to the compiler, with a fake that gives the
    output's shape."""

    def linear(
        xq: Tensor,
        x_scale: Tensor,
        weight: Tensor,
        w_scale: Tensor,
        bias: Tensor | None,
        residual: Tensor | None,
        gelu: bool,
        out_dtype: torch.dtype,
    ) -> Tensor:
        if supported(xq.device):
            if persistent_for(xq, weight):
                # Hopper: the persistent TMA kernel, GELU in its tanh form
                return launch_persistent(xq, x_scale, weight, w_scale, bias, residual,
                                         gelu=gelu, gelu_tanh=gelu, out_dtype=out_dtype,
                                         config=served_config(residual is not None))  # fmt: skip
            return launch(xq, x_scale, weight, w_scale, bias, residual, gelu=gelu,
                          out_dtype=out_dtype)  # fmt: skip
        return reference(xq, x_scale, weight, w_scale, bias, residual, gelu, out_dtype)

    op = torch.library.custom_op(f"serve::{name}", linear, mutates_args=())

    @op.register_fake
    def _(
        xq: Tensor,
        x_scale: Tensor,
        weight: Tensor,
        w_scale: Tensor,
        bias: Tensor | None,
        residual: Tensor | None,
        gelu: bool,
        out_dtype: torch.dtype,
    ) -> Tensor:
        return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)

    return op


int8_linear = define_linear_op("int8_linear", fused_supported, int8_linear_reference)
