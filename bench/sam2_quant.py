"""int8, fp8 and 2:4 on SAM 2.1's Hiera encoder, measured as for SAM's (issue 24 asks for it).

Per size: the fp32 eager model on seeded random weights is the reference; each variant is
the same weights in bf16 with the trunk's block Linear layers (qkv, proj, the MLPs, the
stage-change projections) swapped by `models.quantize.quantize_linears` (the fused Triton
kernel, per-layer choice on calibration images, as `SERVE_QUANTIZATION` does for SAM), or,
for `2:4`, the trunk's MLP layers pruned to 2:4 by magnitude without fine-tuning and run by
cuSPARSELt (`models.sparsity`, as `SERVE_SPARSITY=2:4` does for SAM's encoder), then
`torch.compile` of `Sam2.encode`. Printed per variant: encoder images/s at `--batch`
(CUDA events, median), the image embedding's relative error against fp32 on the photos,
and the mask IoU of one central box per photo (each variant's own decoder in bf16, against
fp32's masks, all four outputs).

    python -m bench.sam2_quant --images .benchdata/images
    python -m bench.sam2_quant --device cpu --sizes sam2_test_tiny --variants bf16 --no-compile
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from pathlib import Path

import torch

from bench.common import DEFAULT_IMAGES, cuda_time_ms, environment, load_photos, print_table
from models.fidelity import mask_iou, relative_error
from models.int8_select import calibration_run
from models.quantize import quantize_linears
from models.sam2 import SAM2_CONFIGS, Sam2, load_sam2
from models.sam2 import transforms as sam2_tf
from models.sparsity import semi_structured_2to4

VARIANTS = ("bf16", "int8", "fp8", "2:4")


def _trunk_linear(name: str, layer: torch.nn.Linear) -> bool:
    return name.startswith("trunk.blocks.")


def _trunk_mlp(name: str, layer: torch.nn.Linear) -> bool:
    return name.startswith("trunk.blocks.") and ".mlp." in name


def _variant(reference: Sam2, variant: str, device: torch.device) -> tuple[Sam2, int]:
    model = copy.deepcopy(reference).to(torch.bfloat16)
    swapped: list[str] = []
    if variant == "2:4":
        # compressed for cuSPARSELt on CUDA; elsewhere the pruned weights stay dense
        compress = device.type == "cuda"
        swapped = semi_structured_2to4(model.image_encoder, _trunk_mlp, compress=compress)
    elif variant != "bf16":
        size = reference.config.image_size
        swapped = quantize_linears(
            model.image_encoder, variant, _trunk_linear,  # type: ignore[arg-type]
            calibrate=calibration_run(size, 2),
        )  # fmt: skip
    return model, len(swapped)


def _masks(model: Sam2, features: list, boxes: torch.Tensor, sizes: list) -> list:
    """Each photo's four masks `[4, H, W]` for its box (multimask and the single mask)."""
    out = []
    for feats, box, size in zip(features, boxes, sizes, strict=True):
        multi = model.decode(feats, None, None, box[None], None, True)
        single = model.decode(feats, None, None, box[None], None, False)
        low = torch.cat([single.low_res_masks, multi.low_res_masks], dim=1)
        masks, _ = sam2_tf.postprocess_masks(low, size, model.config)
        out.append(masks[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", nargs="+", default=["sam2.1_hiera_base_plus", "sam2.1_hiera_large"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    device = torch.device(args.device)
    photos = load_photos(args.images)
    rows = []
    for name in args.sizes:
        config = SAM2_CONFIGS[name]
        reference = load_sam2(config, None, seed=0).to(device).eval()
        S = config.image_size
        inputs = [sam2_tf.preprocess_image(p.numpy(), config)[0].to(device) for p in photos]
        sizes = [(int(p.shape[0]), int(p.shape[1])) for p in photos]
        central = [torch.tensor([[w * 0.3, h * 0.3, w * 0.7, h * 0.7]]) for h, w in sizes]
        boxes = torch.cat(
            [sam2_tf.scale_boxes(b, hw, config) for b, hw in zip(central, sizes, strict=True)]
        ).to(device)
        with torch.inference_mode():
            ref_feats = [reference.encode(x[None]) for x in inputs]
            ref_masks = _masks(reference, ref_feats, boxes, sizes)
        for variant in args.variants:
            model, swapped = _variant(reference, variant, device)
            encode = torch.compile(model.encode) if args.compile else model.encode
            x = torch.randn(args.batch, 3, S, S, device=device, dtype=torch.bfloat16)
            with torch.inference_mode():
                ms = 0.0
                if device.type == "cuda":
                    ms = cuda_time_ms(functools.partial(encode, x), args.iters)
                feats = [encode(i[None].to(torch.bfloat16)) for i in inputs]
                errs = [
                    relative_error(f.image_embed, r.image_embed)
                    for f, r in zip(feats, ref_feats, strict=True)
                ]
                masks = _masks(model, feats, boxes.to(torch.bfloat16), sizes)
            ious = [
                iou
                for a, b in zip(masks, ref_masks, strict=True)
                for iou in mask_iou(a, b).tolist()
            ]
            rows.append(
                {
                    "model": name,
                    "variant": variant,
                    "changed_layers": swapped,
                    "batch": args.batch,
                    "img_s": round(1000 * args.batch / ms, 1) if ms else None,
                    "embed_rel_err": round(statistics.mean(errs), 4),
                    "mask_iou_mean": round(statistics.mean(ious), 4),
                    "mask_iou_min": round(min(ious), 4),
                }
            )
            print(rows[-1], flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, {len(photos)} photos")
    print_table(
        rows,
        ["model", "variant", "changed_layers", "batch", "img_s", "embed_rel_err",
         "mask_iou_mean", "mask_iou_min"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
