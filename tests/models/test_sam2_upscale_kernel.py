"""SAM 2's fused decoder output (`models/sam2/upscale_kernel.py`) against the unfused
modules it replaces, and inside the decoder, eager and compiled.

CI has no GPU, so the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py), where `runs_triton` holds for CPU tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.models.interpreter import run_interpreted_together

OP = r"""
import json, sys
import torch
import torch.nn.functional as F
from torch import nn
from models.sam.common import LayerNorm2d
from models.sam2.upscale_kernel import upscale_masks

results = []
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    P, D, h, w, M = 3, 256, case["h"], case["w"], 4
    up1, norm = nn.ConvTranspose2d(D, D // 4, 2, 2), LayerNorm2d(D // 4)
    up2 = nn.ConvTranspose2d(D // 4, D // 8, 2, 2)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    for module in (up1, norm, up2):
        module.to(dtype)
    skip_rows = P if case["per_prompt_skips"] else 1
    tokens = torch.randn(P, h * w, D).to(dtype)
    s1 = torch.randn(skip_rows, D // 4, 2 * h, 2 * w).to(dtype)
    s0 = torch.randn(skip_rows, D // 8, 4 * h, 4 * w).to(dtype)
    hyper = torch.randn(P, M, D // 8).to(dtype)
    with torch.no_grad():
        x = tokens.transpose(1, 2).reshape(P, D, h, w)
        x = F.gelu(norm(up1(x) + s1))
        x = F.gelu(up2(x) + s0)
        want = (hyper @ x.reshape(P, D // 8, -1)).reshape(P, M, 4 * h, 4 * w)
        # "high": the kernel's products in TF32, operands rounded to it (`_operand`)
        torch.set_float32_matmul_precision(case.get("matmul", "highest"))
        got = upscale_masks(tokens, up1.weight, up1.bias, norm.weight, norm.bias, s1,
                            up2.weight, up2.bias, s0, hyper, h, w, norm.eps)
        torch.set_float32_matmul_precision("highest")
    diff = (got.float() - want.float()).abs()
    results.append({
        "shape": list(got.shape), "dtype": str(got.dtype),
        "max_diff": float(diff.max()), "scale": float(want.float().abs().max()),
        "sign_flips": float(((got > 0) != (want > 0)).float().mean()),
    })
print(json.dumps(results))
"""


OP_CASES = [
    {"seed": 0, "dtype": "float32", "h": 8, "w": 8, "per_prompt_skips": False},
    {"seed": 1, "dtype": "float32", "h": 6, "w": 10, "per_prompt_skips": True},
    {"seed": 2, "dtype": "bfloat16", "h": 8, "w": 8, "per_prompt_skips": True},
    {
        "seed": 3,
        "dtype": "float32",
        "h": 8,
        "w": 8,
        "per_prompt_skips": False,
        "matmul": "high",
    },
]


@pytest.fixture(scope="module")
def interpreted() -> list[list[Any]]:
    """Both scripts' results (OP's, DECODER's), run in one interpreted process: one start
    of Python, torch and Triton for the module instead of one per script."""
    return run_interpreted_together([(OP, OP_CASES), (DECODER, [{}])])


def test_the_kernel_equals_the_unfused_modules(interpreted: list[list[Any]]) -> None:
    for case, result in zip(OP_CASES, interpreted[0], strict=True):
        h, w = case["h"], case["w"]
        assert result["shape"] == [3, 4, 4 * h, 4 * w]
        assert result["dtype"] == f"torch.{case['dtype']}"
        if case.get("matmul") == "high":  # operands rounded to TF32's 10 bits, to nearest
            assert 1e-6 * result["scale"] < result["max_diff"], (case, result)  # rounded
            assert result["max_diff"] <= 2e-3 * result["scale"], (case, result)
            assert result["sign_flips"] < 2e-3, (case, result)
        elif case["dtype"] == "float32":  # full fp32 products ("highest"): rounding only
            assert result["max_diff"] <= 1e-4 * max(1.0, result["scale"]), (case, result)
            assert result["sign_flips"] < 1e-3, (case, result)
        else:  # the unfused path rounds every step to bf16; the kernel keeps fp32
            assert result["max_diff"] <= 0.05 * result["scale"], (case, result)
            assert result["sign_flips"] < 0.02, (case, result)


DECODER = r"""
import json, sys
import torch
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.automatic import point_decoder

torch.manual_seed(0)
model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None).eval()
decoder = model.sam_mask_decoder
results = []
with torch.inference_mode():
    features = model.encode(torch.randn(1, 3, 256, 256))
    points = torch.rand(5, 1, 2) * 256
    labels = torch.ones(5, 1, dtype=torch.int64)
    decoder.fused_upscale = False
    plain = model.decode(features, points, labels, multimask=True)
    decoder.fused_upscale = True
    fused = model.decode(features, points, labels, multimask=True)
    decode = torch.compile(point_decoder(model), dynamic=True, fullgraph=True)
    s0, s1 = features.high_res
    low_res, iou = decode(features.image_embed, s0, s1, points[:, 0], True)
results.append({
    "eager_diff": float((fused.low_res_masks - plain.low_res_masks).abs().max()),
    "iou_diff": float((fused.iou - plain.iou).abs().max()),
    "compiled_diff": float((low_res - plain.low_res_masks).abs().max()),
    "compiled_iou_diff": float((iou - plain.iou).abs().max()),
    "scale": float(plain.low_res_masks.abs().max()),
})
print(json.dumps(results))
"""


def test_the_decoder_with_the_fused_output_eager_and_compiled(
    interpreted: list[list[Any]],
) -> None:
    """The op is opaque to torch.compile (a custom op with a fake): the compiled grid
    decoder calls it and gives the eager decoder's masks."""
    (result,) = interpreted[1]
    tolerance = 1e-4 * max(1.0, result["scale"])
    assert result["eager_diff"] <= tolerance, result
    assert result["compiled_diff"] <= tolerance, result
    assert result["iou_diff"] <= 1e-5 and result["compiled_iou_diff"] <= 1e-5, result
