"""The mask decoder's attention in one Triton kernel, for its lopsided shapes.

The two-way transformer attends image tokens (4,096 at 1024 px) to a prompt's few tokens
(under ten) and back, with a head width of 16. In float32, SDPA's memory-efficient kernel
ran without tensor cores and tiled 64 keys for those few (87 of 163 ms of SAM 2 large's
segment-everything decoder on an H100). Its math kernel, used since, spends about 24 ms
per photo in batched matmuls, some of them in cuBLAS's fp32 kernels without tensor cores,
and writes the score matrices out and back (docs/BENCHMARKS.md, issue 24's tenth session).
This is flash attention's forward sized for these shapes: one program per block of
queries of one (set, head) walks the keys a block at a time with an online softmax. It
reads q, k and v once and writes only the output. Padding keys (`key_valid`) are masked,
and a batch stride of 0 (image tokens shared by every set, `Sam2.share_image`) is read
in place.

Products run in TF32 where PyTorch's float32 matmul precision allows it, otherwise in
full fp32; bf16 and fp16 inputs are exact in TF32. The softmax runs in fp32. On an H100,
SAM 2 large's segment-everything decoder took 90 ms per photo in TF32 with it, 116 without
(docs/BENCHMARKS.md, issue 24's eleventh session), so SAM 2 uses it on CUDA
(`models.sam2.model.default_decoder_paths`, `Attention.fused`).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # importing this module never needs Triton: callers ask `models.triton_device.runs_triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["decoder_attention_fused"]

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _attend(
        Q, K, V, VALID, OUT,
        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, s_valid,
        heads, n_q, n_k, head_dim, scale_log2,
        HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, HEAD)
        row_ok = rows < n_q
        col_ok = cols < head_dim
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
        for start in range(0, n_k, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < n_k
            if HAS_VALID:
                valid = tl.load(VALID + b * s_valid + keys, mask=key_ok, other=0)
                key_ok = key_ok & (valid != 0)
            tile = key_ok[:, None] & col_ok[None, :]
            k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + cols[None, :],
                        mask=tile, other=0.0).to(tl.float32)  # fmt: skip
            v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + cols[None, :],
                        mask=tile, other=0.0).to(tl.float32)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(key_ok[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            # a row with no valid key so far keeps -inf: exp2 of (-inf) - (-inf) is NaN
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            p = tl.math.exp2(s - safe[:, None])
            shrink = tl.math.exp2(best - safe)
            total = total * shrink + tl.sum(p, axis=1)
            acc = acc * shrink[:, None] + tl.dot(p, v, input_precision=PRECISION)
            best = new_best
        out = acc / total[:, None]
        tl.store(OUT + b * sob + h * soh + rows[:, None] * son + cols[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def _launch(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
    B, H, n_q, C = q.shape
    n_k = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(B, H, n_q, C, dtype=q.dtype, device=q.device)
    fp32 = q.dtype == torch.float32
    tf32 = not fp32 or torch.get_float32_matmul_precision() != "highest"
    block_m = 64 if n_q >= 64 else 16
    block_n = 16 if n_k <= 16 else 64
    valid = key_valid if key_valid is not None else out  # unread when HAS_VALID is False
    s_valid = key_valid.stride(0) if key_valid is not None else 0
    grid = (triton.cdiv(n_q, block_m), B * H)
    _attend[grid](
        q, k, v, valid, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        s_valid, H, n_q, n_k, C, C**-0.5 * _LOG2E,
        HAS_VALID=key_valid is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD=max(16, triton.next_power_of_2(C)), PRECISION="tf32" if tf32 else "ieee",
    )  # fmt: skip
    return out


@torch.library.custom_op("sam_serve::decoder_attention", mutates_args=())
def decoder_attention_fused(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(C)) v over the valid keys: q `[B, heads, Nq, C]`, k and v
    `[B, heads, Nk, C]` (any batch and head strides, a contiguous last dim),
    key_valid `[B, Nk]` bool or None -> `[B, heads, Nq, C]`. An opaque op to
    torch.compile (the kernel is already fused)."""
    valid = None if key_valid is None else key_valid.to(torch.uint8)
    return _launch(q, k, v, valid)


@decoder_attention_fused.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
    return q.new_empty(q.shape)
