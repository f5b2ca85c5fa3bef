"""bench/sam2.py's CPU smoke: the tiny test config, ours against Meta's `sam2` in one run.

The GPU run measures speed; here the script must run end to end on the CPU and its
figures must say that both sides ran the same weights (embeddings, a click's masks and
segment everything agree with Meta's fp32 run).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.sam2 import main


def test_cpu_smoke_writes_every_table(small_jpeg_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sam2.json"
    args = ["--device", "cpu", "--sizes", "sam2_test_tiny", "--no-compile", "--batches", "1"]
    args += ["--iters", "1", "--clicks", "2", "--images", str(small_jpeg_dir)]
    args += ["--everything-photos", "1", "--points-per-side", "6"]
    # random weights: thresholds low enough that masks pass (asserted below)
    args += ["--pred-iou-thresh", "0.01", "--stability-thresh", "0.5", "--out", str(out)]
    payload = main(args)
    assert json.loads(out.read_text())["encoder"] == payload["encoder"]

    (encoder,) = payload["encoder"]
    assert encoder["ours_img_s"] > 0 and encoder["meta_img_s"] > 0
    assert encoder["embed_rel_err"] < 0.05  # our bf16 embedding against Meta's fp32 one

    (click,) = payload["click"]
    assert click["ours_click_ms"] > 0 and click["meta_click_ms"] > 0
    assert click["click_miou"] >= 0.9  # bf16 masks against Meta's under autocast

    rows = {row["pipeline"]: row for row in payload["everything"]}
    assert set(rows) == {"meta fp32", "meta autocast bf16", "ours fp32", "ours bf16"}
    assert rows["meta fp32"]["mean_masks"] >= 1
    assert rows["ours fp32"]["mean_masks"] == rows["meta fp32"]["mean_masks"]
    assert rows["ours fp32"]["miou_vs_meta_fp32"] >= 0.98
    assert rows["ours bf16"]["miou_vs_meta_fp32"] >= 0.9
    assert all(row["s_per_image"] > 0 for row in rows.values())


def test_parts_and_pipelines_choose_what_runs(small_jpeg_dir: Path) -> None:
    """A GPU call's time goes to the rows asked for: here segment everything alone, ours
    in fp32 (with the decoder's first layer on one shared image row) against Meta's fp32
    reference."""
    args = ["--device", "cpu", "--sizes", "sam2_test_tiny", "--no-compile"]
    args += ["--images", str(small_jpeg_dir), "--everything-photos", "1"]
    args += ["--points-per-side", "4", "--pred-iou-thresh", "0.01", "--stability-thresh", "0.5"]
    args += ["--parts", "everything", "--everything-pipelines", "fp32", "--no-meta-autocast"]
    args += ["--share-image"]
    payload = main(args)
    assert payload["encoder"] == [] and payload["click"] == []
    rows = {row["pipeline"]: row for row in payload["everything"]}
    assert set(rows) == {"meta fp32", "ours fp32"}
    assert rows["ours fp32"]["miou_vs_meta_fp32"] >= 0.98


def test_the_bf16_transformer_pipeline_keeps_the_rest_of_the_decoder_in_fp32() -> None:
    """`Bf16Transformer` (the "tf32 bf16 transformer compiled" pipeline): the decoder's
    transformer computes in bf16 and hands fp32 back, so its masks are the fp32 decoder's
    up to bf16 rounding in the tokens, and the upscaling's weights stay fp32."""
    import copy

    import torch

    from bench.sam2 import Bf16Transformer
    from models.sam import PromptSet, pack_prompts
    from models.sam2 import SAM2_CONFIGS, load_sam2

    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None)
    mixed = copy.deepcopy(model)
    decoder = mixed.sam_mask_decoder
    decoder.transformer = Bf16Transformer(decoder.transformer)  # type: ignore[assignment]
    assert {p.dtype for p in decoder.transformer.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in decoder.output_upscaling.parameters()} == {torch.float32}
    side = model.config.image_size
    torch.manual_seed(0)
    with torch.inference_mode():
        features = model.encode(torch.randn(1, 3, side, side))
        sets = [
            PromptSet(points=torch.tensor([[side * 0.3, side * 0.6]]), labels=torch.tensor([1]))
        ]
        prompts = pack_prompts(sets, [0], "cpu")
        want, want_iou, _ = model.decode_batch(features, prompts)
        got, got_iou, _ = mixed.decode_batch(features, prompts)
    assert got.dtype == torch.float32
    agree = ((got > 0) == (want > 0)).float().mean()
    assert agree > 0.98, agree
    assert (got_iou - want_iou).abs().max() < 0.05
    assert (got - want).abs().max() > 0  # it did compute in bf16
