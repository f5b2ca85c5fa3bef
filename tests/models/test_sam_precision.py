"""Reduced precision: a bf16 (or fp16) model stays finite and close to the fp32 one."""

from __future__ import annotations

import copy

import pytest
import torch

from models.sam import PromptSet, Sam, pack_prompts

# Relative error against fp32 (measured about 1e-2 for bf16, 2e-3 for fp16 on vit_tiny).
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_low_precision_close_to_fp32(tiny_sam: Sam, dtype: torch.dtype, rel_err) -> None:
    g = torch.Generator().manual_seed(8)
    images = torch.randn(2, 3, 256, 256, generator=g)
    sets = [
        PromptSet([[10.0, 20.0], [100.0, 30.0]], [1, 0]),
        PromptSet(box=[1.0, 2.0, 100.0, 120.0], mask_input=torch.randn(1, 64, 64, generator=g)),
        PromptSet([[50.0, 50.0]], [1], box=[20.0, 20.0, 200.0, 200.0]),
    ]
    # fp32 prompts, as pack_prompts makes them: decode casts them to the model's dtype
    prompts = pack_prompts(sets, [0, 1, 1], "cpu")
    low = copy.deepcopy(tiny_sam).to(dtype)
    with torch.inference_mode():
        embeddings = tiny_sam.encode(images)
        low_res, iou = tiny_sam.decode(embeddings, prompts)
        low_embeddings = low.encode(images)  # encode casts the fp32 batch itself
        low_low_res, low_iou = low.decode(low_embeddings, prompts)
    assert low_embeddings.dtype == low_low_res.dtype == low_iou.dtype == dtype
    for actual in (low_embeddings, low_low_res, low_iou):
        assert bool(torch.isfinite(actual).all())
    tol = TOLERANCE[dtype]
    assert rel_err(low_embeddings, embeddings) < tol
    assert rel_err(low_low_res, low_res) < tol
    assert rel_err(low_iou, iou) < tol
    agreement = ((low_low_res > 0) == (low_res > 0)).float().mean()
    assert float(agreement) > 0.98
