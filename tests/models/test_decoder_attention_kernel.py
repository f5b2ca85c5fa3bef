"""The mask decoder's fused attention (`models/sam/decoder_attention_kernel.py`) against
SDPA, and inside SAM's and SAM 2's decoders, eager and compiled.

CI has no GPU, so the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py), where `runs_triton` holds for CPU
tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.models.interpreter import run_interpreted_together

OP = r"""
import json, sys
import torch
import torch.nn.functional as F
from models.sam.decoder_attention_kernel import decoder_attention_fused

results = []
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    B, H, n_q, n_k, C = case["shape"]
    dtype = getattr(torch, case["dtype"])
    q = torch.randn(B, H, n_q, C).to(dtype)
    kv_batch = 1 if case["shared"] else B
    k = torch.randn(kv_batch, H, n_k, C).to(dtype).expand(B, -1, -1, -1)
    v = torch.randn(kv_batch, H, n_k, C).to(dtype).expand(B, -1, -1, -1)
    valid = None
    if case["padding"]:
        valid = torch.ones(B, n_k, dtype=torch.bool)
        valid[0, -2:] = False
        valid[-1, 1] = False
    mask = None if valid is None else valid[:, None, None, :]
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    got = decoder_attention_fused(q, k, v, valid)
    results.append({"shape": list(got.shape), "dtype": str(got.dtype),
                    "max_diff": float((got.float() - want).abs().max())})
print(json.dumps(results))
"""


OP_CASES = [
        # image -> token: many queries, a few keys, padding masked
        {"seed": 0, "shape": [3, 8, 100, 7, 16], "dtype": "float32", "shared": False,
         "padding": True},
        # token -> image: a few queries, many keys, one image row shared (batch stride 0)
        {"seed": 1, "shape": [3, 8, 7, 300, 16], "dtype": "float32", "shared": True,
         "padding": False},
        # token self-attention: head width 32
        {"seed": 2, "shape": [2, 8, 7, 7, 32], "dtype": "float32", "shared": False,
         "padding": True},
        {"seed": 3, "shape": [3, 8, 70, 9, 16], "dtype": "bfloat16", "shared": False,
         "padding": True},
]  # fmt: skip


@pytest.fixture(scope="module")
def interpreted() -> list[list[Any]]:
    """Both scripts' results, run in one interpreted process (one start of Python, torch
    and Triton for the module instead of one per script)."""
    return run_interpreted_together([(OP, OP_CASES), (DECODERS, [{}])])


def test_the_kernel_equals_sdpa_on_the_decoders_shapes(interpreted: list[list[Any]]) -> None:
    for case, result in zip(OP_CASES, interpreted[0], strict=True):
        assert result["shape"] == [*case["shape"][:3], case["shape"][4]]
        assert result["dtype"] == f"torch.{case['dtype']}"
        limit = 1e-5 if case["dtype"] == "float32" else 0.05  # bf16: the output's rounding
        assert result["max_diff"] <= limit, (case, result)


DECODERS = r"""
import json, sys
import torch
from models.sam import SAM_CONFIGS, load_sam
from models.sam.automatic import single_point_prompts
from models.sam.transformer import use_fused_attention
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.automatic import point_decoder

torch.manual_seed(0)
results = {}
with torch.inference_mode():
    sam2 = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None).eval()
    features = sam2.encode(torch.randn(1, 3, 256, 256))
    points = torch.rand(3, 2, 2) * 256  # three prompts: the interpreter's time is per prompt
    labels = torch.tensor([[1, 0]] * 3)
    plain = sam2.decode(features, points, labels, multimask=True)
    use_fused_attention(sam2.sam_mask_decoder)
    fused = sam2.decode(features, points, labels, multimask=True)
    sam2.share_image = True  # the first layer's image row shared: batch stride 0
    shared = sam2.decode(features, points, labels, multimask=True)
    decode = torch.compile(point_decoder(sam2), dynamic=True, fullgraph=True)
    s0, s1 = features.high_res
    low_res, _ = decode(features.image_embed, s0, s1, points[:, 0], True)
    use_fused_attention(sam2.sam_mask_decoder, False)
    sam2.share_image = False
    plain_one = sam2.decode(features, points[:, :1], labels[:, :1], multimask=True)
    results["sam2_eager"] = float((fused.low_res_masks - plain.low_res_masks).abs().max())
    results["sam2_shared"] = float((shared.low_res_masks - plain.low_res_masks).abs().max())
    results["sam2_compiled"] = float((low_res - plain_one.low_res_masks).abs().max())
    results["sam2_scale"] = float(plain.low_res_masks.abs().max())

    config = SAM_CONFIGS["vit_tiny"]
    sam = load_sam(config, None).eval()
    size = config.image_size
    embedding = sam.image_encoder(torch.randn(1, 3, size, size))
    prompts = single_point_prompts(torch.rand(4, 2) * size)
    want, want_iou = sam.decode(embedding, prompts)
    use_fused_attention(sam.mask_decoder)
    got, got_iou = sam.decode(embedding, prompts)
    results["sam_eager"] = float((got - want).abs().max())
    results["sam_iou"] = float((got_iou - want_iou).abs().max())
    results["sam_scale"] = float(want.abs().max())
print(json.dumps([results]))
"""


def test_the_decoders_give_the_same_masks_through_the_kernel(
    interpreted: list[list[Any]],
) -> None:
    (result,) = interpreted[1]
    sam2_limit = 1e-4 * max(1.0, result["sam2_scale"])
    for key in ("sam2_eager", "sam2_shared", "sam2_compiled"):
        assert result[key] <= sam2_limit, (key, result)
    assert result["sam_eager"] <= 1e-4 * max(1.0, result["sam_scale"]), result
    assert result["sam_iou"] <= 1e-5, result
