"""Self-attention with SAM's decomposed relative positions, in two interchangeable forms.

SAM's encoder adds `q(y, x) . Rh[y - y'] + q(y, x) . Rw[x - x']` to every attention score
(MViTv2's decomposed relative positions). Written out, that bias is a `[B, heads, N, N]`
tensor: for the global blocks of ViT-B at 1024 px, N = 4096, i.e. 400 MB per image in bf16,
read once more than the attention itself. The forms here start from the two small factors
`rel_h [B, heads, N, h]` and `rel_w [B, heads, N, w]`:

- `sdpa`: expands them into the dense bias and calls `scaled_dot_product_attention` (the
  reference form; any device, eager or compiled; cheap for 14x14 windows);
- `flex`: FlexAttention with a score modification that adds `rel_h[.., kv // w]` and
  `rel_w[.., kv % w]` per tile inside the fused kernel, so the dense bias never exists.
  It is fused only under `torch.compile` (eagerly it falls back to an unfused reference);
- `triton`: our flash-attention kernel (`fused_attention.py`) that computes both factors
  from the tables itself, adds `rel_h` per key row and keeps the `rel_w` tile in
  registers; CUDA only, rows of keys up to `MAX_GRID_W`. It is reached only through one
  custom op, `fused_rel_pos_attention`, opaque to the compiler and captured by CUDA
  graphs: the encoder calls it by `fused_qkv_attention`, straight on its qkv projection,
  and `rel_pos_attention(..., "triton")` on q, k and v stacked so.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

__all__ = [
    "AttentionImpl",
    "dense_bias",
    "flex_rel_pos_attention",
    "fused_qkv_attention",
    "rel_pos_attention",
    "rel_pos_terms",
]

AttentionImpl = Literal["sdpa", "flex", "triton"]


def relative_index(size: int, device: torch.device) -> Tensor:
    """`[size, size]` indices into a `[2*size-1, C]` table: (query - key) + size - 1."""
    pos = torch.arange(size, device=device)
    return pos[:, None] - pos[None, :] + (size - 1)


def _check_tables(rel_pos_h: Tensor, rel_pos_w: Tensor, h: int, w: int) -> None:
    if rel_pos_h.shape[0] != 2 * h - 1 or rel_pos_w.shape[0] != 2 * w - 1:
        raise ValueError(
            f"rel-pos tables {tuple(rel_pos_h.shape)}/{tuple(rel_pos_w.shape)} do not fit a "
            f"{h}x{w} grid; the input must be the config's image size"
        )


def rel_pos_terms(
    q: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, h: int, w: int
) -> tuple[Tensor, Tensor]:
    """The two factors of the decomposed bias: (`[B, heads, h*w, h]`, `[B, heads, h*w, w]`).

    q: `[B, heads, h*w, C]` (unscaled queries); rel_pos_h `[2h-1, C]`, rel_pos_w `[2w-1, C]`.
    Queries and keys share one grid (self-attention), so no table interpolation is needed.
    """
    _check_tables(rel_pos_h, rel_pos_w, h, w)
    B, heads, _, C = q.shape
    Rh = rel_pos_h[relative_index(h, q.device)].to(q.dtype)  # [h, h', C]
    Rw = rel_pos_w[relative_index(w, q.device)].to(q.dtype)  # [w, w', C]
    grid_q = q.reshape(B, heads, h, w, C)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid_q, Rh)  # [B, heads, h, w, h']
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid_q, Rw)  # [B, heads, h, w, w']
    return rel_h.reshape(B, heads, h * w, h), rel_w.reshape(B, heads, h * w, w)


def dense_bias(rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """The bias written out, `[B, heads, N, h*w]`: bias[q, (y', x')] = rel_h[q, y'] + rel_w[q, x'].

    What `flex` avoids: for a 64x64 grid this is the size of the attention matrix itself.
    """
    B, heads, N, h = rel_h.shape
    return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(B, heads, N, h * rel_w.shape[-1])


def rel_pos_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    grid: tuple[int, int],
    impl: AttentionImpl = "sdpa",
) -> Tensor:
    """softmax(q k^T / sqrt(C) + bias) v for `[B, heads, h*w, C]` q, k, v on an h x w grid."""
    h, w = grid
    if impl == "triton":
        from models.sam.fused_attention import rel_pos_flash

        _check_tables(rel_pos_h, rel_pos_w, h, w)
        B, heads, N, C = q.shape
        # the op's layout, [B, N, 3, heads, C] (one copy the encoder's qkv projection spares)
        qkv = torch.stack((q, k, v), dim=2).permute(0, 3, 2, 1, 4)
        out = rel_pos_flash(qkv, rel_pos_h, rel_pos_w)  # [B, N, heads * C]
        return out.view(B, N, heads, C).transpose(1, 2)
    rel_h, rel_w = rel_pos_terms(q, rel_pos_h, rel_pos_w, h, w)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_bias(rel_h, rel_w))
    return flex_rel_pos_attention(q, k, v, rel_h, rel_w)


def fused_qkv_attention(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    grid: tuple[int, int],
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    """The Triton kernel straight on the qkv projection: `[B, N, 3, heads, C]` ->
    `[B, N, heads * C]`, ready for the output projection (no permute or copy either side;
    the kernel computes the rel-pos terms from the tables itself); int8 by `out_inv_scale`
    where the projection takes its input by fixed scales."""
    from models.sam.fused_attention import rel_pos_flash

    _check_tables(rel_pos_h, rel_pos_w, *grid)
    return rel_pos_flash(qkv, rel_pos_h, rel_pos_w, out_inv_scale)


def flex_rel_pos_attention(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """FlexAttention adding `rel_h[.., kv // w] + rel_w[.., kv % w]` to each score in the kernel.

    q, k, v: `[B, heads, h*w, C]`; rel_h `[B, heads, h*w, h]`, rel_w `[B, heads, h*w, w]`.
    """
    w = rel_w.shape[-1]

    def add_rel_pos(score: Tensor, b: Tensor, n: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # kv_idx = y' * w + x'; the bias is not scaled, as in Meta's encoder.
        return score + rel_h[b, n, q_idx, kv_idx // w] + rel_w[b, n, q_idx, kv_idx % w]

    out = flex_attention(q, k, v, score_mod=add_rel_pos)
    assert isinstance(out, Tensor)
    return out
