"""Quantized and 2:4-sparse Linear layers, and the load-time transforms that apply them."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from models.optimize import GraphedBuckets, OptimizeOptions, compile_fn, prepare_sam_encoder
from models.quantize import (
    INT8_MAX_KEPT,
    DynamicQuantLinear,
    Fp8DynamicLinear,
    Fp8RowwiseLinear,
    Int8DynamicLinear,
    int8_mm,
    linear_reference,
    prune_2to4,
    quantization_unsupported,
    quantize_linears,
    semi_structured_2to4,
    torchao_unsupported,
)
from models.sam import Sam


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    ("cls", "tol"),
    [(Int8DynamicLinear, 1.5e-2), (Fp8DynamicLinear, 6e-2), (Fp8RowwiseLinear, 6e-2)],
)
def test_quantized_linear_approximates_float(cls, tol):
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=g) / 8)
        layer.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 40, 64, generator=g)
    q = cls(layer)
    out = q(x)
    assert out.shape == (3, 40, 48) and out.dtype == torch.float32
    err = rel(out, layer(x))
    assert 0 < err < tol  # quantized (not exact), yet close
    # the weight rounding alone accounts for part of the error, the activations for the rest
    assert rel(linear_reference(q, x), layer(x)) < err


def test_quantize_linears_swaps_what_is_asked_and_fits():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Linear(10, 32))
    swapped = quantize_linears(model, "int8", lambda name, layer: name != "0")
    # "0" excluded by the filter; "2" and "3" have a dimension that is not a multiple of 16
    assert swapped == []
    swapped = quantize_linears(model, "int8", lambda name, layer: True)
    assert swapped == ["0"]
    assert isinstance(model[0], Int8DynamicLinear)
    assert quantize_linears(model, "none", lambda n, layer: True) == []


def test_the_share_kept_in_float_is_read_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`quantize_linears` without `max_kept` takes `INT8_MAX_KEPT` as the module holds it
    when called, so a bench can time the encoder with fewer float layers (`-kept0`). Every
    layer's error is past a bar of 0 here, so the choice keeps as many as the share allows."""
    import models.quantize as quantize

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    samples = torch.randn(8, 32, generator=g)
    monkeypatch.setattr(quantize, "INT8_MAX_ERROR", 0.0)

    def floats(max_kept: float) -> int:
        monkeypatch.setattr(quantize, "INT8_MAX_KEPT", max_kept)
        quantized = copy.deepcopy(model)
        quantize_linears(quantized, "int8", lambda n, layer: True, calibrate=lambda m: m(samples))
        return sum(type(m) is nn.Linear for m in quantized)

    assert floats(0.5) == 2 and floats(0.0) == 0


def test_prune_2to4_keeps_the_two_largest_of_every_four():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    pruned = prune_2to4(w)
    groups, kept = w.reshape(8, 4, 4), pruned.reshape(8, 4, 4)
    assert ((kept != 0).sum(-1) == 2).all()
    top2 = groups.abs().topk(2, dim=-1).values.sum(-1)
    torch.testing.assert_close(kept.abs().sum(-1), top2)
    with pytest.raises(ValueError, match="divisible by 4"):
        prune_2to4(torch.randn(4, 6))


def test_semi_structured_dense_fallback_prunes_in_place():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    done = semi_structured_2to4(model, lambda name, layer: name == "1", compress=False)
    assert done == ["1"]
    assert ((model[1].weight.reshape(16, 8, 4) != 0).sum(-1) <= 2).all()
    assert (model[0].weight != 0).all()


def test_variant_names():
    assert OptimizeOptions().variant == "fp32"
    assert OptimizeOptions(precision="bf16", quantization="fp8").variant == "bf16+fp8"
    opts = OptimizeOptions(precision="bf16", quantization="int8", sparsity="2:4")
    assert opts.variant == "bf16+int8+2:4"
    opts = OptimizeOptions(precision="bf16", quantization="fp8", norm_quant=True, mlp_hop=True)
    assert opts.variant == "bf16+fp8+lnq+hop"
    assert OptimizeOptions(precision="bf16", norm_quant=True).variant == "bf16"  # no effect
    assert opts.dtype == torch.bfloat16


@pytest.mark.parametrize(("quantization", "tol"), [("int8", 0.05), ("fp8", 0.15)])
def test_prepared_encoder_stays_close(tiny_sam: Sam, quantization, tol):
    model = copy.deepcopy(tiny_sam)
    prepare_sam_encoder(
        model.image_encoder,
        OptimizeOptions(quantization=quantization, attention="flex"),
        torch.device("cpu"),
    )
    blocks = model.image_encoder.blocks
    linears = [m for b in blocks for m in b.modules() if isinstance(m, nn.Linear)]
    swapped = [m for b in blocks for m in b.modules() if isinstance(m, DynamicQuantLinear)]
    assert {m.kind for m in swapped} == {quantization}
    # the worst-measured layers stay in float (models.int8_select), at most this many
    kept = int(INT8_MAX_KEPT * (len(linears) + len(swapped)))
    assert len(linears) <= kept and len(swapped) >= 3 * kept
    for b in blocks:  # GELU runs in lin1's epilogue wherever lin1 is quantised
        if isinstance(b.mlp.lin1, DynamicQuantLinear):
            assert b.mlp.lin1.gelu and isinstance(b.mlp.act, nn.Identity)
        else:
            assert isinstance(b.mlp.act, nn.GELU)
    assert [b.attn.impl for b in blocks] == ["flex" if b.window == 0 else "sdpa" for b in blocks]
    images = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        err = rel(model.encode(images), tiny_sam.encode(images))
    assert 0 < err < tol


def test_compile_off_is_the_function_itself_and_graphs_fall_back_on_cpu():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert compile_fn(fn, "none", dynamic=True) is fn
    graphed = GraphedBuckets(fn, enabled=True)  # no CUDA here: plain calls
    graphed.capture(torch.ones(2))
    assert graphed.captured == []
    torch.testing.assert_close(graphed(torch.ones(3)), torch.full((3,), 2.0))


# -- the torchao backend (int8 on the CPU; torchao's fp8 needs a GPU of capability 8.9+) --


def test_torchao_backend_quantizes_the_same_layers_and_stays_close(tiny_sam: Sam):
    from torchao.quantization import Int8Tensor

    core, ao = copy.deepcopy(tiny_sam), copy.deepcopy(tiny_sam)
    cpu = torch.device("cpu")
    # every candidate layer, as torchao takes them (core's per-layer choice would keep some)
    every = OptimizeOptions(quantization="int8", quantization_backend="int_mm")
    prepare_sam_encoder(core.image_encoder, every, cpu)
    options = OptimizeOptions(quantization="int8", quantization_backend="torchao")
    assert options.variant == "fp32+int8+torchao"
    prepare_sam_encoder(ao.image_encoder, options, cpu)
    core_layers = {n for n, m in core.image_encoder.named_modules()
                   if isinstance(m, Int8DynamicLinear)}  # fmt: skip
    ao_layers = {n for n, m in ao.image_encoder.named_modules()
                 if isinstance(m, nn.Linear) and isinstance(m.weight, Int8Tensor)}  # fmt: skip
    assert core_layers == ao_layers and len(ao_layers) > 0
    images = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = tiny_sam.encode(images)
        err = rel(ao.encode(images), want)
    assert 0 < err < 0.05
    # the two int8 schemes round alike: neither is far from the other
    with torch.inference_mode():
        assert rel(ao.encode(images), core.encode(images)) < 2 * rel(core.encode(images), want)


def test_torchao_says_why_it_cannot(monkeypatch):
    cpu = torch.device("cpu")
    assert torchao_unsupported("int8", cpu) is None
    assert "needs CUDA" in str(torchao_unsupported("fp8", cpu))
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if not installed
    assert "does not import" in str(torchao_unsupported("int8", cpu))


def test_the_int8_product_takes_a_column_major_activation_as_a_row_major_one() -> None:
    """cuBLASLt refuses a column-major int8 activation of 65,536 rows or more on an H100
    (bench/int8_probe.py), and a compiled graph may hand one over: `int8_mm` makes it
    row-major first, and a compiled `Int8DynamicLinear` fed a column-major input gives
    exactly the eager module's output."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (300, 96), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=g).t()
    column_major = a.t().contiguous().t()
    assert not column_major.is_contiguous()
    assert torch.equal(int8_mm(column_major, b), torch._int_mm(a, b))
    module = Int8DynamicLinear(torch.nn.Linear(96, 48))
    x = torch.randn(6, 50, 96, generator=g)
    strided = x.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # same values, other strides
    compiled = torch.compile(module, dynamic=False)
    assert torch.equal(compiled(strided), module(x))


def test_a_kind_the_gpu_cannot_run_is_refused_at_load_naming_the_setting(monkeypatch):
    """No GPU here: the capability query is answered as an A100's (8.0) would be, which
    has int8 tensor cores but no fp8 ones. The CPU runs every kind (torch references)."""
    assert quantization_unsupported("fp8", "core", torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    why = quantization_unsupported("fp8", "core", cuda)
    assert why is not None and "SERVE_QUANTIZATION=fp8" in why and "8.0" in why
    assert quantization_unsupported("int8", "core", cuda) is None
    assert quantization_unsupported("none", "core", cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "SERVE_QUANTIZATION=int8" in str(quantization_unsupported("int8", "int_mm", cuda))
    # what quantize_linears raises, start-up turns into its refusal with what to do instead
    from server.engine.build import variant_refusal
    from tests.server.conftest import small_settings

    refusal = variant_refusal(small_settings(quantization="fp8"), torch.device("cpu"),
                              "loading Swin", NotImplementedError(why))  # fmt: skip
    assert refusal is not None and str(refusal).startswith("SERVE_QUANTIZATION=fp8 cannot run")
    assert "SERVE_QUANTIZATION=none" in str(refusal)
