"""SAM 2's mask-decoder output (upscaling, high-res skips and hypernetwork) in one kernel.

After the two-way transformer, each prompt's image tokens `[h*w, D]` are turned into its
mask logits by:
1. a 2x2 stride-2 transposed convolution to `D/4` channels;
2. the stride-8 skip added, a channel LayerNorm and a GELU;
3. another 2x2 stride-2 transposed convolution to `D/8` channels;
4. the stride-4 skip added and a GELU;
5. a product with the mask tokens' hypernetwork outputs, `[4, D/8]` per prompt.

Unfused, that writes and reads back float maps of `D/4 x 2h x 2w` and `D/8 x 4h x 4w` per
prompt: 4 and 8 MiB in fp32 at 1024 px. In TF32, on an H100, the transposed convolutions
and the pointwise kernels around them were about 30 ms of the 117 ms that SAM 2 large's
segment-everything decoder spends per photo (docs/BENCHMARKS.md, issue 24's tenth
session). Here one program takes a band of source pixels of one prompt through all five
steps in registers. A source pixel's four children, and their four children each, depend
on nothing else, so only the final logits are written.

Measured on an H100 it loses to inductor, so it stays off (`Sam2MaskDecoder.fused_upscale`,
`models.sam2.model.default_decoder_paths`). For 256 prompts at 1024 px
(`python -m bench.sam2_upscale`, docs/BENCHMARKS.md, issue 24's eleventh session) the
compiled modules took 7.7 ms in TF32 and 4.8 in bf16. This kernel took 11.5 and 7.4 ms at
its best block (64 source pixels, 4 warps), 22.3 ms at 32. The tenth session's version
(the skips read channels-first, the tokens once per tap) made the whole decoder 45 ms a
photo slower, 161 against 116 ms.

Float32 products run in TF32 where PyTorch's float32 matmul precision allows it (as the
unfused path's cuBLAS and cuDNN calls do), otherwise in full fp32. bf16 and fp16
inputs are exact in TF32. Everything after the products (biases, skips, the norm, the
GELUs, the second product's input, the hypernetwork sums) stays in fp32. The unfused
path rounds each of those steps to the model's dtype, so the two agree in fp32 and only
approximately in bf16 (tests/models/test_sam2_upscale_kernel.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # importing this module never needs Triton: callers ask `models.triton_device.runs_triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["upscale_masks"]

# Source pixels per program and warps: the fastest of 32/64/128 x 4/8 in both precisions
# on an H100 but one (bf16: 128 and 8 warps, 6.5 ms) with bench/sam2_upscale.py
BLOCK = 64
NUM_WARPS = 4
_BLOCK_K = 64  # input channels per product step


if triton is not None:

    @triton.jit
    def _gelu(x):
        """nn.GELU()'s exact form."""
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _tap(
        a, T1: tl.constexpr, p, y, x, ok, h, w, eps,
        B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
        s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x,
        C1: tl.constexpr, C2: tl.constexpr, MASKS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One tap of the first convolution, `a` `[BLOCK, C1]` (its product, for the
        block's source pixels), through the norm and on to its 4 x 4 output pixels."""
        c1 = tl.arange(0, C1)
        c2 = tl.arange(0, C2)
        yy = 2 * y + T1 // 2
        xx = 2 * x + T1 % 2
        # the skips are read channels-last (`upscale_masks` lays them out so): a pixel's
        # channels are one contiguous run, where channels-first scattered them a plane apart
        skip = tl.load(S1 + p * s1_p + c1[None, :] * s1_c
                       + (yy * s1_y + xx * s1_x)[:, None]).to(tl.float32)  # fmt: skip
        a = a + tl.load(B1 + c1).to(tl.float32)[None, :] + skip
        mean = tl.sum(a, axis=1) / C1
        centred = a - mean[:, None]
        var = tl.sum(centred * centred, axis=1) / C1
        g = centred * (1.0 / tl.sqrt(var + eps))[:, None]
        lnw = tl.load(LNW + c1).to(tl.float32)
        lnb = tl.load(LNB + c1).to(tl.float32)
        g = _gelu(g * lnw[None, :] + lnb[None, :])
        b2 = tl.load(B2 + c2).to(tl.float32)
        plane0 = 16 * h * w  # (4h) x (4w)
        for t2 in tl.static_range(4):  # the second convolution's tap (k, l)
            Y = 2 * yy + t2 // 2
            Xc = 2 * xx + t2 % 2
            w2 = tl.load(W2 + (t2 * C1 + c1[:, None]) * C2 + c2[None, :]).to(tl.float32)
            z = tl.dot(g, w2, input_precision=PRECISION) + b2[None, :]
            skip0 = tl.load(S0 + p * s0_p + c2[None, :] * s0_c
                            + (Y * s0_y + Xc * s0_x)[:, None]).to(tl.float32)  # fmt: skip
            z = _gelu(z + skip0)
            for m in tl.static_range(MASKS):
                hyper = tl.load(HYPER + (p * MASKS + m) * C2 + c2).to(tl.float32)
                logit = tl.sum(z * hyper[None, :], axis=1)
                tl.store(OUT + (p * MASKS + m) * plane0 + Y * 4 * w + Xc,
                         logit.to(OUT.dtype.element_ty), mask=ok)  # fmt: skip

    @triton.jit
    def _upscale(
        X, W1, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
        s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, h, w, eps,
        D: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, MASKS: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(1).to(tl.int64)
        pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = pix < h * w
        pix = tl.minimum(pix, h * w - 1)  # past the end: computed, never stored
        y = pix // w
        x = pix % w
        c1 = tl.arange(0, C1)
        kk = tl.arange(0, BLOCK_K)
        rows = X + p * h * w * D + pix[:, None] * D
        # the four taps' products from one read of each chunk of the tokens
        a0 = tl.zeros([BLOCK, C1], dtype=tl.float32)
        a1 = tl.zeros([BLOCK, C1], dtype=tl.float32)
        a2 = tl.zeros([BLOCK, C1], dtype=tl.float32)
        a3 = tl.zeros([BLOCK, C1], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):
            xs = tl.load(rows + k0 + kk[None, :]).to(tl.float32)
            taps = W1 + (k0 + kk[:, None]) * C1 + c1[None, :]
            a0 = tl.dot(xs, tl.load(taps).to(tl.float32), a0, input_precision=PRECISION)
            a1 = tl.dot(xs, tl.load(taps + D * C1).to(tl.float32), a1, input_precision=PRECISION)
            a2 = tl.dot(xs, tl.load(taps + 2 * D * C1).to(tl.float32), a2,
                        input_precision=PRECISION)  # fmt: skip
            a3 = tl.dot(xs, tl.load(taps + 3 * D * C1).to(tl.float32), a3,
                        input_precision=PRECISION)  # fmt: skip
        _tap(a0, 0, p, y, x, ok, h, w, eps, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
             s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, C1, C2, MASKS, PRECISION)  # fmt: skip
        _tap(a1, 1, p, y, x, ok, h, w, eps, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
             s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, C1, C2, MASKS, PRECISION)  # fmt: skip
        _tap(a2, 2, p, y, x, ok, h, w, eps, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
             s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, C1, C2, MASKS, PRECISION)  # fmt: skip
        _tap(a3, 3, p, y, x, ok, h, w, eps, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
             s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, C1, C2, MASKS, PRECISION)  # fmt: skip


def _taps(weight: Tensor) -> Tensor:
    """ConvTranspose2d weight `[in, out, 2, 2]` -> `[4, in, out]`, tap (i, j) at `2 i + j`."""
    return weight.permute(2, 3, 0, 1).reshape(4, weight.shape[0], weight.shape[1]).contiguous()


@torch.library.custom_op("sam_serve::sam2_upscale_masks", mutates_args=())
def upscale_masks(
    tokens: Tensor,
    w1: Tensor,
    b1: Tensor,
    ln_w: Tensor,
    ln_b: Tensor,
    s1: Tensor,
    w2: Tensor,
    b2: Tensor,
    s0: Tensor,
    hyper: Tensor,
    h: int,
    w: int,
    eps: float,
) -> Tensor:
    """Image tokens `[P, h*w, D]` -> mask logits `[P, M, 4h, 4w]` in the tokens' dtype.

    w1/b1: the first ConvTranspose2d (`[D, D/4, 2, 2]`, `[D/4]`); ln_w/ln_b/eps: the
    LayerNorm2d; s1 `[P or 1, D/4, 2h, 2w]`, s0 `[P or 1, D/8, 4h, 4w]`: the projected
    skips; w2/b2: the second ConvTranspose2d; hyper `[P, M, D/8]`: the mask tokens'
    hypernetwork outputs. An opaque op to torch.compile (the kernel is already fused)."""
    P, _, D = tokens.shape
    C1, C2, masks = w1.shape[1], w2.shape[1], hyper.shape[1]
    out = torch.empty(P, masks, 4 * h, 4 * w, dtype=tokens.dtype, device=tokens.device)
    # operands go to the tensor cores as float32: TF32 holds a bf16 or fp16 value exactly
    # (and Triton's interpreter, the CPU tests', multiplies bf16 wrongly); fp32 ones are
    # rounded to TF32 only where PyTorch's matmul precision allows it
    fp32 = tokens.dtype == torch.float32
    tf32 = not fp32 or torch.get_float32_matmul_precision() != "highest"
    w1r, w2r = _taps(w1.to(tokens.dtype)), _taps(w2.to(tokens.dtype))
    # channels-last skips: one copy of a shared skip per call (8 MiB at 1024 px in fp32),
    # none where the producer wrote them so
    s1, s0 = (t.contiguous(memory_format=torch.channels_last) for t in (s1, s0))
    # a skip shared by every prompt (segment everything: one image) is read with stride 0
    s1_strides = (0 if s1.shape[0] == 1 else s1.stride(0), *s1.stride()[1:])
    s0_strides = (0 if s0.shape[0] == 1 else s0.stride(0), *s0.stride()[1:])
    grid = (triton.cdiv(h * w, BLOCK), P)
    _upscale[grid](
        tokens.contiguous(), w1r, b1, ln_w, ln_b, s1, w2r, b2, s0, hyper.contiguous(), out,
        *s1_strides, *s0_strides, h, w, eps,
        D=D, C1=C1, C2=C2, MASKS=masks, BLOCK=BLOCK, BLOCK_K=min(_BLOCK_K, D),
        PRECISION="tf32" if tf32 else "ieee", num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


@upscale_masks.register_fake
def _(
    tokens: Tensor,
    w1: Tensor,
    b1: Tensor,
    ln_w: Tensor,
    ln_b: Tensor,
    s1: Tensor,
    w2: Tensor,
    b2: Tensor,
    s0: Tensor,
    hyper: Tensor,
    h: int,
    w: int,
    eps: float,
) -> Tensor:
    return tokens.new_empty(tokens.shape[0], hyper.shape[1], 4 * h, 4 * w)
