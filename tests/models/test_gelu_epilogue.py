"""GELU in the first MLP GEMM's epilogue (`SERVE_MLP_GELU`): which layers it takes, that the
checkpoint's names and the outputs survive it, and how `auto` resolves per device.

On CUDA the layer is one cuBLASLt call (`torch._addmm_activation`); here, on the CPU, the
same tanh-form GELU runs after the product, so these tests check what the swap does to the
model, and bench/sam_encoder.py (`-gelu`) and bench/swin.py (`bf16-gelu-compile`) measure
its speed and fidelity on the GPU (docs/BENCHMARKS.md, issue 20).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.optimize import OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.quantize import DynamicQuantLinear, GeluLinear, gelu_epilogue, quantize_linears
from models.sam import Sam
from models.sam.common import MLPBlock
from models.swin import SWIN_CONFIGS, load_swin
from server.engine.build import optimize_options
from server.settings import Settings


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_layer_is_gelus_tanh_form_after_the_product() -> None:
    g = torch.Generator().manual_seed(0)
    plain = nn.Linear(24, 96)
    layer = GeluLinear(24, 96)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 24, generator=g)
    with torch.inference_mode():
        expected = F.gelu(plain(x), approximate="tanh")
        assert torch.equal(layer(x), expected)
        # and close to the exact erf the models were trained with
        assert rel(layer(x), F.gelu(plain(x))) < 1e-3


def test_sam_encoder_mlps_take_it_and_keep_their_names(tiny_sam: Sam) -> None:
    model = copy.deepcopy(tiny_sam)
    keys = list(model.state_dict())
    prepare_sam_encoder(
        model.image_encoder, OptimizeOptions(gelu_epilogue=True), torch.device("cpu")
    )
    blocks = [b.mlp for b in model.image_encoder.blocks]
    assert blocks and all(type(m.lin1) is GeluLinear for m in blocks)
    assert all(isinstance(m.act, nn.Identity) for m in blocks)
    # the decoder's MLPs (ReLU) are not the encoder's and stay as they were
    decoder_mlps = [m for m in model.mask_decoder.modules() if isinstance(m, MLPBlock)]
    assert decoder_mlps and all(type(m.lin1) is nn.Linear for m in decoder_mlps)
    assert list(model.state_dict()) == keys  # a checkpoint still loads by the same names
    x = torch.randn(1, 3, model.config.image_size, model.config.image_size)
    with torch.inference_mode():
        exact, epilogue = tiny_sam.image_encoder(x), model.image_encoder(x)
    assert 0 < rel(epilogue, exact) < 1e-3


def test_swin_mlps_take_it_and_the_logits_stay_close() -> None:
    swin = load_swin(SWIN_CONFIGS["swin_test"], None, seed=3).eval()
    model = copy.deepcopy(swin)
    prepare_swin(model, OptimizeOptions(gelu_epilogue=True))
    swapped = [m for m in model.modules() if type(m) is GeluLinear]
    blocks = [m for m in model.modules() if type(m).__name__ == "Mlp"]
    assert len(swapped) == len(blocks) > 0
    side = SWIN_CONFIGS["swin_test"].img_size
    x = torch.randn(2, 3, side, side)
    with torch.inference_mode():
        assert rel(model(x), swin(x)) < 1e-3


def test_quantised_layers_are_left_to_their_own_gelu(tiny_sam: Sam) -> None:
    """An int8 lin1 applies the exact GELU in its own epilogue (models.quantize.fuse_gelu);
    only the MLPs the per-layer choice kept in float take the tanh epilogue."""
    encoder = copy.deepcopy(tiny_sam.image_encoder)
    first = encoder.blocks[0].mlp
    quantize_linears(first, "int8", lambda name, layer: name == "lin1")
    assert isinstance(first.lin1, DynamicQuantLinear)
    fused = gelu_epilogue(encoder)
    assert "blocks.0.mlp.lin1" not in fused
    assert isinstance(first.lin1, DynamicQuantLinear)
    assert len(fused) == len(encoder.blocks) - 1


@pytest.mark.parametrize(
    ("setting", "device", "precision", "expected"),
    [
        ("auto", "cuda", "auto", True),  # bf16 on CUDA: the measured win
        ("auto", "cuda", "fp16", True),
        ("auto", "cuda", "fp32", False),  # fp32 is asked for fidelity: the exact erf
        ("auto", "cpu", "auto", False),  # nothing to gain on the CPU
        ("exact", "cuda", "auto", False),
        ("epilogue", "cpu", "auto", True),  # asked for: the same numbers as a GPU's
    ],
)
def test_auto_resolves_per_device_and_precision(
    setting: str, device: str, precision: str, expected: bool
) -> None:
    settings = Settings(mlp_gelu=setting, precision=precision)  # type: ignore[arg-type]
    options = optimize_options(settings, torch.device(device))
    assert options.gelu_epilogue is expected
    # responses name it: the numbers differ from the exact model's
    assert options.variant.endswith("+tanh_gelu") is expected, options.variant


def test_a_layer_with_the_epilogue_is_never_quantised(tiny_sam: Sam) -> None:
    """Quantising after the swap would drop GELU (the quantised layer is built from the
    weights alone): the epilogue's layers are not candidates."""
    encoder = copy.deepcopy(tiny_sam.image_encoder)
    gelu_epilogue(encoder)
    swapped = quantize_linears(encoder, "int8", lambda name, layer: ".mlp." in name)
    assert swapped and not any(name.endswith("lin1") for name in swapped)
    assert all(type(b.mlp.lin1) is GeluLinear for b in encoder.blocks)
