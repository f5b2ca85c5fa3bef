"""SAM 2's mask-decoder output (upscaling, high-res skips and hypernetwork) in one kernel.

After the two-way transformer, each prompt's image tokens `[h*w, D]` are turned into its
mask logits by:
1. a 2x2 stride-2 transposed convolution to `D/4` channels;
2. the stride-8 skip added, a channel LayerNorm and a GELU;
3. another 2x2 stride-2 transposed convolution to `D/8` channels;
4. the stride-4 skip added and a GELU;
5. a product with the mask tokens' hypernetwork outputs, `[4, D/8]` per prompt.

Unfused, that writes and reads back float maps of `D/4 x 2h x 2w` and `D/8 x 4h x 4w` per
prompt: 4 and 8 MiB in fp32 at 1024 px, about 12 GB of memory traffic for a segment-
everything call of 256 prompt sets. Here one program takes a block of source pixels of one
prompt through all five steps; a source pixel's four children, and their four children
each, depend on nothing else, so only the final logits are written. A program works on
one tap of the first convolution at a time (a loop, so one accumulator is live and the
code stays small), and the hypernetwork product is a tensor-core product too.

On an H100 (docs/BENCHMARKS.md, issue 24's twenty-second session; `python -m
bench.sam2_upscale`, 256 prompt sets at 1024 px) it takes 5.0-5.3 ms a call in TF32
against 7.3 for inductor's compiled modules and 19.6 eager, and 3.8-4.2 in bf16 against
4.4; segment everything took 111-118 ms a photo with it against 121-125 without, at the
same mIoU. So it is on where Triton compiles (`models.sam2.model.default_decoder_paths`).
Its first two forms (four accumulators live, the hypernetwork sums on CUDA cores) took
11.5-22 ms and stayed off.

Float32 products run in TF32 where PyTorch's float32 matmul precision allows it (as the
unfused path's cuBLAS and cuDNN calls do), their operands rounded to the nearest TF32
value first (`_operand`: the tensor cores alone truncate, which left 1.2e-3 of the logits'
range against cuBLAS's 2.2e-4; rounded, 3.5e-4), otherwise in full fp32. bf16 and fp16
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

# Source pixels per program, warps and input channels per product step (chosen on a GPU:
# `python -m bench.sam2_upscale` times each; the module globals are what it varies)
BLOCK = 128
NUM_WARPS = 4
NUM_STAGES = 2
BLOCK_K = 64
MASKS_PADDED = 16  # the hypernetwork product's width: tl.dot wants N >= 16


if triton is not None:

    @triton.jit
    def _gelu(x):
        """nn.GELU()'s exact form."""
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _operand(x, PRECISION: tl.constexpr):
        """A product's float32 operand, rounded to the nearest TF32 value where the product
        runs in TF32. The tensor cores drop the 13 low bits (truncation: each product
        biased toward zero, 1.2e-3 of the logits' range after the three products against
        cuBLAS and cuDNN's 2.2e-4, measured on an H100); rounding first matches them.
        Integer ops, so Triton's interpreter runs it too."""
        if PRECISION == "tf32":
            bits = x.to(tl.int32, bitcast=True)
            x = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)  # -8192: ~0x1FFF
        return x

    @triton.jit
    def _upscale(
        X, W1, B1, LNW, LNB, S1, W2, B2, S0, HYPER, OUT,
        s1_p, s1_c, s1_y, s1_x, s0_p, s0_c, s0_y, s0_x, h, w, eps,
        D: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, MASKS: tl.constexpr,
        MP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(1).to(tl.int64)
        pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = pix < h * w
        pix = tl.minimum(pix, h * w - 1)  # past the end: computed, never stored
        y = pix // w
        x = pix % w
        c1 = tl.arange(0, C1)
        c2 = tl.arange(0, C2)
        kk = tl.arange(0, BLOCK_K)
        mm = tl.arange(0, MP)
        b1 = tl.load(B1 + c1).to(tl.float32)
        lnw = tl.load(LNW + c1).to(tl.float32)
        lnb = tl.load(LNB + c1).to(tl.float32)
        b2 = tl.load(B2 + c2).to(tl.float32)
        # the hypernetwork outputs as a [C2, MP] operand, the padding columns zero
        hyper = tl.load(HYPER + (p * MASKS + mm[None, :]) * C2 + c2[:, None],
                        mask=mm[None, :] < MASKS, other=0.0).to(tl.float32)  # fmt: skip
        hyper = _operand(hyper, PRECISION)
        rows = X + p * h * w * D + pix[:, None] * D
        plane0 = 16 * h * w  # (4h) x (4w)
        keep = ok[:, None] & (mm[None, :] < MASKS)
        # one tap of the first convolution at a time (a loop, not unrolled): one [BLOCK, C1]
        # accumulator live, the block's tokens read once per tap (from L1/L2 after the first)
        for t1 in range(4):
            acc = tl.zeros([BLOCK, C1], dtype=tl.float32)
            for k0 in tl.range(0, D, BLOCK_K, num_stages=STAGES):
                xs = _operand(tl.load(rows + k0 + kk[None, :]).to(tl.float32), PRECISION)
                w1 = tl.load(W1 + (t1 * D + k0 + kk[:, None]) * C1 + c1[None, :])
                w1 = _operand(w1.to(tl.float32), PRECISION)
                acc = tl.dot(xs, w1, acc, input_precision=PRECISION)
            yy = 2 * y + t1 // 2
            xx = 2 * x + t1 % 2
            # the skips are read channels-last (`upscale_masks` lays them out so): a
            # pixel's channels are one contiguous run
            skip = tl.load(S1 + p * s1_p + c1[None, :] * s1_c
                           + (yy * s1_y + xx * s1_x)[:, None]).to(tl.float32)  # fmt: skip
            a = acc + b1[None, :] + skip
            mean = tl.sum(a, axis=1) / C1
            centred = a - mean[:, None]
            var = tl.sum(centred * centred, axis=1) / C1
            g = centred * (1.0 / tl.sqrt(var + eps))[:, None]
            g = _operand(_gelu(g * lnw[None, :] + lnb[None, :]), PRECISION)
            for t2 in range(4):  # the second convolution's taps, each to 4 logits a pixel
                Y = 2 * yy + t2 // 2
                Xc = 2 * xx + t2 % 2
                w2 = tl.load(W2 + (t2 * C1 + c1[:, None]) * C2 + c2[None, :])
                w2 = _operand(w2.to(tl.float32), PRECISION)
                z = tl.dot(g, w2, input_precision=PRECISION) + b2[None, :]
                skip0 = tl.load(S0 + p * s0_p + c2[None, :] * s0_c
                                + (Y * s0_y + Xc * s0_x)[:, None]).to(tl.float32)  # fmt: skip
                z = _operand(_gelu(z + skip0), PRECISION)
                logits = tl.dot(z, hyper, input_precision=PRECISION)  # [BLOCK, MP]
                tl.store(OUT + (p * MASKS + mm[None, :]) * plane0 + (Y * 4 * w + Xc)[:, None],
                         logits.to(OUT.dtype.element_ty), mask=keep)  # fmt: skip


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
        D=D, C1=C1, C2=C2, MASKS=masks, MP=max(MASKS_PADDED, triton.next_power_of_2(masks)),
        BLOCK=BLOCK, BLOCK_K=min(BLOCK_K, D), PRECISION="tf32" if tf32 else "ieee",
        STAGES=NUM_STAGES, num_warps=NUM_WARPS,
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
