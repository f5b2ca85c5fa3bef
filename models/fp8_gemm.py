"""fp8 (e4m3) x fp8 GEMM with the dequantisation, bias, GELU and residual in its epilogue.

Why: the earlier fp8 path (`torch._scaled_mm` with rowwise scales, `Fp8RowwiseLinear`) ran
Swin-T 6% slower than bf16 on an H100, its bias and GELU separate kernels after a bf16
product. Here fp8 goes through `models.int8_gemm`'s kernel, accumulating in fp32 instead of
int32 (Hopper's fp8 tensor cores, twice bf16's rate; compute capability 8.9 on), with the
same fused epilogue and the same tiles, autotuner and layout:

- `xq [M, K]` float8_e4m3fn, one fp32 scale per row (token): its absmax over 448;
- `weight [N, K]` float8_e4m3fn contiguous (K-major, what fp8 wgmma wants for B) with one
  fp32 scale per output channel, prepared once at load time (`models.quantize`).

`fp8_linear` is a torch custom op like `serve::int8_linear`; off CUDA (tests, CPU serving)
it runs the same arithmetic in torch: the fp8 operands widened to fp32 (their products are
exact there), summed by a fp32 matmul, then the epilogue in the kernel's order.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from models.int8_gemm import define_linear_op, epilogue_reference, triton_gemm_available

__all__ = [
    "FP8",
    "FP8_MAX",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_supported",
    "quantize_rows_fp8",
    "quantize_weight_fp8",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_EPS = 1e-12


@functools.cache
def fp8_supported(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA with Triton and fp8 tensor cores (compute
    capability 8.9 on: Ada, Hopper). Elsewhere `fp8_linear` runs its torch reference."""
    if device.type != "cuda" or not triton_gemm_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """`x [M, K]` float -> (`[M, K]` e4m3, `[M]` fp32 scales): one scale per row, its absmax
    over 448 (the format's largest finite value; the clamp keeps the rounding of the
    largest element from overflowing to NaN). Plain torch ops: inductor fuses them."""
    x = x.float()
    scale = x.abs().amax(dim=1).clamp(min=_EPS) / FP8_MAX
    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`[N, K]` -> (`[N, K]` e4m3 contiguous, `[N]` fp32 scales): per output channel."""
    q, scale = quantize_rows_fp8(weight.detach())
    return q.contiguous(), scale


def fp8_linear_reference(
    xq: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    gelu: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """The kernel's arithmetic in torch: the fp32 product of the e4m3 operands, then the
    epilogue (`models.int8_gemm.epilogue_reference`)."""
    acc = xq.float() @ weight.float().t()  # [M, N]
    return epilogue_reference(acc, x_scale, w_scale, bias, residual, gelu, out_dtype)


# with e4m3 `xq` and `weight`: the Triton kernel where it runs, the torch reference elsewhere
fp8_linear = define_linear_op("fp8_linear", fp8_supported, fp8_linear_reference)
