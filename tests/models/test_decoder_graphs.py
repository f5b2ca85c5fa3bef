"""The decoder's graph buffers: a batch copied into the padded static buffers (sets padded
to a bucket, tokens padded to a token bucket) decodes to what the decoder gives the batch
as it is. On the CPU no graph is captured, but the buffers, slices and padding a replay
reads are the same ones (models.sam.decoder_graphs)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor

from models.sam import PromptSet, Sam, pack_prompts
from models.sam.decoder_graphs import DecoderGraphs
from models.sam.transformer import decoder_attention

TOL = 1e-4


@pytest.fixture(scope="module")
def embeddings(tiny_sam: Sam) -> Tensor:
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        return tiny_sam.encode(torch.randn(2, 3, 256, 256, generator=g))


@pytest.fixture()
def graphs(tiny_sam: Sam) -> DecoderGraphs:
    size = tiny_sam.prompt_encoder.image_embedding_size[0]
    g = DecoderGraphs(
        tiny_sam.decode,
        embedding_shape=(256, size, size),
        mask_size=4 * size,
        dtype=torch.float32,
        device=torch.device("cpu"),
        set_buckets=[1, 2, 4, 8],
    )
    with torch.inference_mode():
        for sets in g.set_buckets:
            g.capture(sets)
    return g


def _sets(n: int, seed: int, *, points: int = 1, mask: bool = False) -> list[PromptSet]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        box = None if k % 3 else torch.tensor([20.0, 30.0, 120.0, 160.0]) + k
        labels = torch.randint(0, 2, (points,), generator=g)
        m = torch.randn(1, 64, 64, generator=g) * 3 if mask and k % 2 else None
        out.append(PromptSet(torch.rand(points, 2, generator=g) * 250, labels, box, m))
    return out


def _check(tiny_sam: Sam, graphs: DecoderGraphs, embeddings: Tensor, sets: list[PromptSet]):
    """`run_sets` (the tokens padded and sent in one copy, as the stages serve) against the
    decoder on the batch as it is."""
    rows = [embeddings[k % 2] for k in range(len(sets))]
    with torch.inference_mode():
        out = graphs.run_sets((rows,), sets)
        assert out is not None
        want = tiny_sam.decode(torch.stack(rows), pack_prompts(sets, None, "cpu", mask_size=64))
    for got, expected in zip(out, want, strict=True):
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert torch.allclose(got, expected, atol=TOL, rtol=TOL), (got - expected).abs().max()
    return out


def test_buckets_cover_what_they_should(graphs: DecoderGraphs) -> None:
    assert graphs.captured == [(s, t) for s in (1, 2, 4, 8) for t in (2, 4, 8)]
    assert graphs.bucket(3, 3) == (4, 4) and graphs.bucket(1, 2) == (1, 2)
    assert graphs.bucket(9, 2) is None and graphs.bucket(2, 9) is None


def test_padded_sets_and_tokens_decode_as_the_batch_alone(tiny_sam, graphs, embeddings) -> None:
    _check(tiny_sam, graphs, embeddings, _sets(3, 1))  # 3 sets in the 4 bucket, 2-3 tokens
    _check(tiny_sam, graphs, embeddings, _sets(5, 2, points=3, mask=True))  # 8 bucket, 4
    _check(tiny_sam, graphs, embeddings, _sets(1, 3, points=6))  # 7 tokens in the 8 bucket


def test_a_smaller_batch_after_a_larger_one_is_not_mixed_with_it(
    tiny_sam, graphs, embeddings
) -> None:
    # rows and tokens the first batch filled are stale for the second: they must not leak
    _check(tiny_sam, graphs, embeddings, _sets(8, 4, points=5, mask=True))
    first = _check(tiny_sam, graphs, embeddings, _sets(5, 5, points=1))
    again = _check(tiny_sam, graphs, embeddings, _sets(5, 5, points=1))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_image_inputs_are_named_one_way(tiny_sam: Sam) -> None:
    common = {
        "mask_size": 64,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        "set_buckets": [1],
    }
    for shapes in ({}, {"embedding_shape": (256, 16, 16), "input_shapes": [(256, 16, 16)]}):
        with pytest.raises(ValueError, match="embedding_shape or input_shapes"):
            DecoderGraphs(tiny_sam.decode, **shapes, **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one image input"):
        DecoderGraphs(tiny_sam.decode, input_shapes=[], **common)  # type: ignore[arg-type]


def test_decoder_attention_nests_and_restores_the_flags():
    """A graph capture enters `decoder_attention` around a stage's decode function, which
    enters it again: that must not block (a plain lock deadlocked on the GPU), and on the
    way out every backend flag is as it was."""
    before = [
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
    ]
    done = threading.Event()

    def nested() -> None:
        with decoder_attention(torch.bfloat16):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled()
            with decoder_attention(torch.float32):  # plain matmuls: the math kernel alone
                assert not torch.backends.cuda.flash_sdp_enabled()
                assert not torch.backends.cuda.mem_efficient_sdp_enabled()
                q = torch.randn(1, 2, 3, 8)
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
            assert torch.backends.cuda.mem_efficient_sdp_enabled()
        done.set()

    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(10), "decoder_attention blocked when entered twice by one thread"
    assert before == [
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
    ]


def test_sets_sent_in_one_copy_decode_as_the_batch_alone(tiny_sam, graphs, embeddings) -> None:
    _check(tiny_sam, graphs, embeddings, _sets(3, 11))
    _check(tiny_sam, graphs, embeddings, _sets(1, 12, points=6))  # 7 tokens of 8
    _check(tiny_sam, graphs, embeddings, _sets(8, 13, points=2))


def test_mask_inputs_of_one_batch_never_reach_the_next(tiny_sam, graphs, embeddings) -> None:
    """A refinement batch sets mask rows; the next batch without masks must decode as if
    none had been given (its rows' flags cleared), and the padding of fewer tokens after
    more must not leak either."""
    _check(tiny_sam, graphs, embeddings, _sets(5, 14, points=3, mask=True))
    plain = _check(tiny_sam, graphs, embeddings, _sets(4, 15))
    _check(tiny_sam, graphs, embeddings, _sets(4, 16, points=2, mask=True))
    again = _check(tiny_sam, graphs, embeddings, _sets(4, 15))
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))


def test_sets_no_bucket_holds_are_left_to_the_caller(graphs, embeddings) -> None:
    with torch.inference_mode():
        with pytest.raises(ValueError, match="2 image inputs for a decoder of 1"):
            graphs.run_sets(([embeddings[0]] * 2, [embeddings[0]] * 2), _sets(2, 20))
        assert graphs.run_sets(([embeddings[0]] * 9,), _sets(9, 17)) is None
        assert graphs.run_sets(([embeddings[0]],), _sets(1, 18, points=8)) is None
        with pytest.raises(ValueError, match="3 rows of an image input for 2 prompt sets"):
            graphs.run_sets(([embeddings[0]] * 3,), _sets(2, 19))
