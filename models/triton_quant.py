"""Triton device functions shared by our kernels: a tile of fp32 rows quantised to int8 or
e4m3 (models.ln_quant's LayerNorm, the GEMMs' epilogues for the MLP hop), and the GEMMs'
dequantisation, bias and GELU (models.gemm_kernel, models.gemm_persistent: one arithmetic,
so the two kernels cannot drift apart). Imported only by code that already has Triton.

Rounding is done in fp32 and is torch's, half to even: int8 by adding and subtracting
1.5 * 2^23; e4m3 by rounding onto its grid (step 2^(exponent - 3), 2^-9 under the smallest
normal) before the cast, which is then exact. Triton's interpreter casts 7.9 to e4m3 as 4.0
(a carry into the exponent lost), the GPU's `cvt.rn` would not; one arithmetic for both
keeps the CPU tests meaningful.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dequantize_bias_gelu", "quantize_fixed", "quantize_rows_tile"]


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
        q = _round_to_int8(y / scale[:, None])
    return q, scale


@triton.jit
def _round_to_int8(v):  # noqa: ANN001
    """`v` fp32 -> int8, rounded half to even and clamped to +-127, without a
    float-to-integer conversion: those run on the SFU's quarter-rate pipe beside GELU's
    tanh and the softmax's exponentials, where a GEMM's epilogue has one for every output
    (ncu: lin1's epilogue, one `F2I` an output). Adding 1.5 * 2^23 leaves the rounded
    integer in the sum's low mantissa bits, so its low byte is the int8 value."""
    v = tl.minimum(tl.maximum(v, -127.0), 127.0) + 12582912.0
    return v.to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def quantize_fixed(y, inv):  # noqa: ANN001, ANN201
    """`y [R, C]` fp32 -> int8 by fixed per-column scales (`inv [C]` their inverses), so
    that any tile can write it without a row's maximum; rounded half to even as
    torch.round, then clamped to +-127."""
    return _round_to_int8(y * inv[None, :])


@triton.jit
def dequantize_bias_gelu(  # noqa: ANN201
    acc, xs, WS, BIAS, offs_n, mask_n,  # noqa: ANN001, N803
    HAS_XS: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,  # noqa: N803
):  # fmt: skip
    """A GEMM tile's epilogue arithmetic in fp32, in the order of
    models.int8_gemm.int8_linear_reference: `acc [R, C]` (int32 or fp32) times the rows'
    scales `xs [R]` (where `HAS_XS`; otherwise they are in the sum or the weight already)
    and the columns' `WS[offs_n]`, plus `BIAS[offs_n]`, then GELU: 1 the exact erf, 2 the
    tanh form with tanh as the SFU's one instruction, 3 the tanh form by exp (what
    Triton's interpreter can run)."""
    ws = tl.load(WS + offs_n, mask=mask_n, other=0.0)
    if HAS_XS:  # noqa: SIM108 (a constexpr branch: xs may be None)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    else:
        y = acc * ws[None, :]
    if HAS_BIAS:
        y = y + tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GELU == 1:  # exact, as nn.GELU()
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif GELU > 1:
        # sqrt(2 / pi) (y + 0.044715 y^3) as y (c1 + c3 y^2), and 0.5 y (1 + t) as h + h t:
        # five instructions besides tanh, where the formula as written takes seven
        u = y * tl.fma(y * y, 0.035677408136300125, 0.7978845608028654)
        if GELU == 2:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u],
                                          dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
        else:
            t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
        h = 0.5 * y
        y = tl.fma(h, t, h)
    return y
