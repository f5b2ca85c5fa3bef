"""bench.sam_encoder's runtime switches: a variant's module globals hold for its whole run
and are put back after, so variants with and without them compare in one process."""

from __future__ import annotations

import pytest

from bench.sam_encoder import PAIRED, VARIANTS, _variant, runtime_knobs
from models import gemm_persistent, ln_quant
from models.gemm_persistent import SWEEP
from models.sam import fused_attention


def test_a_variant_s_switches_hold_inside_and_are_put_back() -> None:
    name = "bf16-gelu-int8-lnq-static-pres-compile-triton-win-pad128-x2"
    assert name in VARIANTS
    # the switches leave the model's options alone: the same variant name for clients
    assert _variant(name) == _variant("bf16-gelu-int8-lnq-static-pres-compile-triton-win")
    before = fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED
    with runtime_knobs(name):
        assert ln_quant.PACK_PAD == 128 and gemm_persistent.SERVED == PAIRED
        assert not fused_attention.DENSE_ROWS
    with pytest.raises(RuntimeError), runtime_knobs("bf16-gelu-compile-triton-win-dense"):
        assert fused_attention.DENSE_ROWS and ln_quant.PACK_PAD == 16
        raise RuntimeError("a variant that fails still puts them back")
    assert before == (fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED)
    with runtime_knobs("bf16-gelu-int8-lnq-static-pres-compile-triton-win-ln2x2"):
        assert ln_quant.SHAPE == (2, 2) and ln_quant.launch_shape(1024) == (2, 2)
        assert not fused_attention.ROWSUM_DOT
    with runtime_knobs("bf16-gelu-compile-triton-win-dense-rowdot"):
        assert fused_attention.ROWSUM_DOT and fused_attention.DENSE_ROWS
    assert ln_quant.SHAPE is None and not fused_attention.ROWSUM_DOT
    assert ln_quant.launch_shape(1024) == (4, 4)  # the served shape
    assert PAIRED in SWEEP  # a shape the products' sweep times too


def test_a_padded_variant_compiles_its_own_width_not_the_cached_one() -> None:
    """Inductor's cache keys the graph, not the norm's fake output width: without the
    knobs turning it off, the second compile loads the first's size asserts (seen on the
    H200 as `stride 896==784`)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    x = torch.randn(6, 32)

    def packed_width(name: str) -> int:
        torch._dynamo.reset()
        with runtime_knobs(name):
            norm = ln_quant.QuantizingLayerNorm(nn.LayerNorm(32), fp8=False)
            return torch.compile(norm)(x).shape[-1]

    base = "bf16-gelu-int8-lnq-static-pres-compile-triton-win"
    assert packed_width(base) == 32 + 16
    assert packed_width(f"{base}-pad128") == 32 + 128
    torch._dynamo.reset()
