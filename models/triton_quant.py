"""Triton device functions that quantise a tile of fp32 rows to int8 or e4m3, shared by the
kernels that write quantised activations (models.ln_quant's LayerNorm, models.int8_gemm's
epilogue for the MLP hop). Imported only by code that already has Triton.

Rounding is done in fp32 and is torch's, half to even: int8 by adding and subtracting
1.5 * 2^23; e4m3 by rounding onto its grid (step 2^(exponent - 3), 2^-9 under the smallest
normal) before the cast, which is then exact. Triton's interpreter casts 7.9 to e4m3 as 4.0
(a carry into the exponent lost), the GPU's `cvt.rn` would not; one arithmetic for both
keeps the CPU tests meaningful.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["quantize_rows_tile"]


@triton.jit
def quantize_rows_tile(y, mask, IS_FP8: tl.constexpr):  # noqa: ANN001, ANN201, N803
    """`y [R, C]` fp32 (`mask`ed entries ignored) -> (`[R, C]` int8 values, or e4m3's bytes
    as int8; `[R]` fp32 scales: each row's absmax over 127 or 448)."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)
    if IS_FP8:
        scale = tl.maximum(amax, 1e-12) / 448.0
        v = tl.minimum(tl.maximum(y / scale[:, None], -448.0), 448.0)
        exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        v = ((v / step + 12582912.0) - 12582912.0) * step
        q = v.to(tl.float8e4nv).to(tl.int8, bitcast=True)
    else:
        scale = tl.maximum(amax, 1e-12) / 127.0
        v = (y / scale[:, None] + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)
    return q, scale
