"""SAM's two-way transformer: prompt tokens and image tokens attend to each other.

Prompt sets of different lengths share one batch: `token_valid [P, T]` marks the real
tokens, and every attention whose keys are tokens (token self-attention, image-to-token
attention) masks the padding out. Padding tokens still produce queries; their outputs are
never read, so a set decoded in a batch gives the same result as decoded alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.sam.common import MLPBlock
from models.sam.decoder_attention_kernel import decoder_attention_fused
from models.triton_device import runs_triton

__all__ = ["TwoWayTransformer", "decoder_attention", "use_fused_attention"]

# Not cuDNN's fused attention: it builds an execution plan for each new shape on its first
# call, 40 to 100 ms each (1 s for the first) on an H100 with torch 2.11, and a decoder's
# shapes change with every batch's prompt count. Flash and memory-efficient attention
# start at once and were as fast on these shapes (bench/sdpa_probe.py, docs/BENCHMARKS.md).
_DECODER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Decoders of these dtypes attend through plain matmuls and a softmax. In float32 SDPA
# picks the memory-efficient kernel, whose fp32 version has no tensor cores and tiles 64
# keys where image-to-token attention has fewer than ten: 87 of the 163 ms of SAM 2
# hiera-large's segment-everything decoder on an H100 (TF32 matmuls; `python -m
# bench.everything_stages --dtypes tf32`, docs/BENCHMARKS.md). In bf16 the math kernel
# measured no faster than flash attention. A bench may add a dtype to compare.
MATH_ATTENTION_DTYPES: set[torch.dtype] = {torch.float32}
# sdpa_kernel sets process-wide flags and restores them on exit: two decoder threads
# interleaving their enter and exit could leave them restricted for everyone after.
# Reentrant: a graph capture enters it around a stage's decode function, which enters it
# again (a plain lock deadlocked there).
_BACKENDS_LOCK = threading.RLock()


@contextlib.contextmanager
def decoder_attention(dtype: torch.dtype) -> Iterator[None]:
    """The attention kernels a mask decoder (SAM's, SAM 2's) of `dtype` runs, compiled or
    captured or eager: wrap every decoder call in this. A compiled decoder keeps the
    kernels chosen when it was traced."""
    backends = [SDPBackend.MATH] if dtype in MATH_ATTENTION_DTYPES else _DECODER_BACKENDS
    with _BACKENDS_LOCK, sdpa_kernel(backends):
        yield


class Attention(nn.Module):
    """Multi-head attention whose q/k/v projections may shrink the width (`downsample_rate`)."""

    def __init__(self, embedding_dim: int, num_heads: int, downsample_rate: int = 1) -> None:
        super().__init__()
        self.num_heads = num_heads
        internal = embedding_dim // downsample_rate
        if internal % num_heads:
            raise ValueError("num_heads must divide the internal attention width")
        self.q_proj = nn.Linear(embedding_dim, internal)
        self.k_proj = nn.Linear(embedding_dim, internal)
        self.v_proj = nn.Linear(embedding_dim, internal)
        self.out_proj = nn.Linear(internal, embedding_dim)
        # one Triton kernel for the decoder's lopsided shapes
        # (models/sam/decoder_attention_kernel.py): SAM 2 on CUDA sets it
        # (`models.sam2.model.default_decoder_paths`); SAM's decoder has not been measured
        self.fused = False

    def _heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None = None) -> Tensor:
        """q `[B, Nq, D]`, k/v `[B, Nk, D]`, key_valid `[B, Nk]` bool -> `[B, Nq, D]`.

        One side may have a batch of 1 (image tokens shared by every prompt set): it is
        projected once and broadcast to the other's batch.
        """
        mask = None if key_valid is None else key_valid[:, None, None, :]
        qh = self._heads(self.q_proj(q))
        kh, vh = self._heads(self.k_proj(k)), self._heads(self.v_proj(v))
        if qh.shape[0] != kh.shape[0]:
            batch = max(qh.shape[0], kh.shape[0])
            qh, kh, vh = (t.expand(batch, -1, -1, -1) for t in (qh, kh, vh))
        if self.fused and runs_triton(qh.device):
            out = decoder_attention_fused(qh, kh, vh, key_valid)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)  # [B, heads, Nq, C]
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class TwoWayAttentionBlock(nn.Module):
    """Token self-attn, token->image cross-attn, token MLP, image->token cross-attn."""

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        mlp_dim: int,
        downsample_rate: int,
        skip_first_layer_pe: bool,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(embedding_dim, num_heads)
        self.norm1 = nn.LayerNorm(embedding_dim)
        self.cross_attn_token_to_image = Attention(embedding_dim, num_heads, downsample_rate)
        self.norm2 = nn.LayerNorm(embedding_dim)
        self.mlp = MLPBlock(embedding_dim, mlp_dim, nn.ReLU)
        self.norm3 = nn.LayerNorm(embedding_dim)
        self.norm4 = nn.LayerNorm(embedding_dim)
        self.cross_attn_image_to_token = Attention(embedding_dim, num_heads, downsample_rate)
        self.skip_first_layer_pe = skip_first_layer_pe

    def forward(
        self, queries: Tensor, keys: Tensor, query_pe: Tensor, key_pe: Tensor, token_valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        """queries `[P, T, D]` tokens, keys `[P, hw, D]` image -> both updated."""
        if self.skip_first_layer_pe:
            # The first layer's queries are the prompt embeddings themselves.
            queries = self.self_attn(queries, queries, queries, token_valid)
        else:
            q = queries + query_pe
            queries = queries + self.self_attn(q, q, queries, token_valid)
        queries = self.norm1(queries)

        q = queries + query_pe
        k = keys + key_pe
        queries = self.norm2(queries + self.cross_attn_token_to_image(q, k, keys))
        queries = self.norm3(queries + self.mlp(queries))

        q = queries + query_pe
        k = keys + key_pe
        keys = self.norm4(keys + self.cross_attn_image_to_token(k, q, queries, token_valid))
        return queries, keys


class TwoWayTransformer(nn.Module):
    """`depth` two-way blocks and a final token->image attention."""

    def __init__(
        self,
        depth: int,
        embedding_dim: int,
        num_heads: int,
        mlp_dim: int,
        attention_downsample_rate: int = 2,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TwoWayAttentionBlock(
                embedding_dim, num_heads, mlp_dim, attention_downsample_rate, i == 0
            )
            for i in range(depth)
        )
        self.final_attn_token_to_image = Attention(
            embedding_dim, num_heads, attention_downsample_rate
        )
        self.norm_final_attn = nn.LayerNorm(embedding_dim)

    def forward(
        self, image: Tensor, image_pe: Tensor, tokens: Tensor, token_valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        """image `[P or 1, D, h, w]`, image_pe `[1, D, h, w]`, tokens `[P, T, D]`,
        token_valid `[P, T]`. One image row is shared by every set until the first
        image-to-token attention makes the rows differ.

        Returns (tokens `[P, T, D]`, image tokens `[P, h*w, D]`).
        """
        keys = image.flatten(2).transpose(1, 2)
        key_pe = image_pe.flatten(2).transpose(1, 2)
        queries = tokens
        for layer in self.layers:
            queries, keys = layer(queries, keys, tokens, key_pe, token_valid)
        q = queries + tokens
        k = keys + key_pe
        queries = self.norm_final_attn(queries + self.final_attn_token_to_image(q, k, keys))
        return queries, keys


def use_fused_attention(module: nn.Module, on: bool = True) -> None:
    """Every decoder `Attention` inside `module` through the fused kernel (or back)."""
    for child in module.modules():
        if isinstance(child, Attention):
            child.fused = on
