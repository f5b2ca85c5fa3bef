"""The mask decoder's attention shapes per SDPA backend: the first call at each new shape
and the steady time (issue 21; a GPU script).

A start-up profile (`SPY=1 bash bench/gpu_startup.sh`) found the decoder's graph captures
spending their time inside `scaled_dot_product_attention`. This runs the decoder's three
attentions (token self-attention, token-to-image, image-to-token; 8 heads, 4096 image
tokens, bf16, a key mask where the keys are tokens) for every (prompt sets, tokens)
bucket the service captures, once with torch's default backend choice and once with
`models.sam.transformer.decoder_attention`'s, and prints the sum of the first calls (a new
shape each) and, per shape, first and steady times and the backend torch picked
(`torch._fused_sdp_choice`: 1 flash, 2 memory-efficient, 3 cuDNN).

    python3 -m bench.sdpa_probe
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import environment, print_table
from models.sam.transformer import decoder_attention

SETS = (1, 2, 4, 8, 16, 32)
TOKENS = (2, 4, 8)
IMAGE_TOKENS = 4096  # 64 x 64
HEADS = 8


def _shapes(sets: int, tokens: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], bool]]:
    """(name, query shape, key shape, masked): the decoder's three attentions."""
    token_dim, image_dim = 256 // HEADS, 128 // HEADS  # cross-attention downsamples by 2
    token = (sets, HEADS, tokens, token_dim)
    image_query = (sets, HEADS, tokens, image_dim)
    image_key = (sets, HEADS, IMAGE_TOKENS, image_dim)
    return [
        ("self", token, token, True),
        ("token->image", image_query, image_key, False),
        ("image->token", image_key, image_query, True),
    ]


def _repeat(fn: Callable[[], object], times: int) -> None:
    for _ in range(times):
        fn()


def _time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def probe(
    backends: Callable[[], contextlib.AbstractContextManager[Any]], iters: int
) -> list[dict[str, Any]]:
    rows = []
    for sets in SETS:
        for tokens in TOKENS:
            for name, q_shape, k_shape, masked in _shapes(sets, tokens):
                q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(k_shape, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(k_shape, device="cuda", dtype=torch.bfloat16)
                ones = torch.ones(sets, 1, 1, k_shape[2], dtype=torch.bool, device="cuda")
                mask = ones if masked else None
                with backends():
                    call = functools.partial(F.scaled_dot_product_attention, q, k, v, mask)
                    first = _time(call)
                    for _ in range(3):
                        call()
                    steady = _time(functools.partial(_repeat, call, iters)) / iters
                    choice = torch._fused_sdp_choice(q, k, v, mask)
                rows.append({"sets": sets, "tokens": tokens, "attention": name,
                             "first_ms": first * 1e3, "steady_us": steady * 1e6,
                             "backend": choice})  # fmt: skip
    return rows


@contextlib.contextmanager
def _default() -> Iterator[None]:
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("a GPU script: no CUDA device here")
    print(environment(), "cuDNN attention enabled:", torch.backends.cuda.cudnn_sdp_enabled())
    # the process's first attention (CUDA context, cuBLAS, libraries) is no shape's cost
    x = torch.randn(1, HEADS, 3, 24, device="cuda", dtype=torch.bfloat16)
    _time(lambda: F.scaled_dot_product_attention(x, x, x))
    bf16_decoder = functools.partial(decoder_attention, torch.bfloat16)  # the probe's dtype
    for label, backends in (("default", _default), ("decoder_attention", bf16_decoder)):
        rows = probe(backends, args.iters)
        total = sum(r["first_ms"] for r in rows) / 1e3
        print(f"\n{label}: first calls of the {len(rows)} shapes sum to {total:.2f} s")
        print_table(rows, ["sets", "tokens", "attention", "first_ms", "steady_us", "backend"])


if __name__ == "__main__":
    main()
