"""Which of SAM ViT-B's encoder layers fp8 could take at issue 20's mask IoU floor (0.98).

Why: 600 img/s is out of bf16's reach on Hopper (docs/BENCHMARKS.md, issue 20's thirteenth
session: the attention at SDPA's floor and the GEMMs at the chip's bf16 rate would still
take 13.9 ms a batch of 8, 575 img/s), so the GEMMs would have to run in fp8 or int8. fp8
rowwise on every block Linear cost 7.5% embedding error and mask IoU 0.941 on the GPU
(random weights). This measures, by kind of layer (the attention's qkv and projection, the
MLP's two products), what fp8 on that kind alone does to the masks, so that the fused fp8
kernels are built where the fidelity allows them.

The arithmetic is the served fp8 kernel's (`models.fp8_gemm.fp8_linear_reference`: e4m3
operands, per-row activation and per-channel weight scales, an fp32 product) in fp32,
through `bench.fp8_sensitivity.QuantizedLayers`; fidelity is `models.fidelity.compare_sam`'s
(five prompts a photo, all four masks of each, against fp32 eager on the same weights).
Random weights (seed 0, the service's) unless `--weights` names a checkpoint. On a 2-core
CPU an encoder pass takes about 9 s a photo: `--photos 3 --variants all mlp` is a few
minutes; every variant on the 7 photos about 10. `--format int8` puts the served int8
kernel's arithmetic (per-row and per-channel int8, an exact int32 product) there instead.

`--format int8-static` and `int8-static-tensor`: int8 whose activation scales are not
measured per token but fixed in advance, per input channel or one per layer, from the
largest value each layer's input reached on the photos mirrored left to right (a
calibration set the measured photos are not; `calibrate`). Why: a per-token scale needs the
whole row's maximum, which no GEMM tile sees, so lin2's input (lin1's 3,072-wide output)
and proj's (the attention's output) each take a pass of their own over memory; a fixed
scale lets the op before write int8 directly (a per-channel scale folds into the next
layer's weight columns, SmoothQuant's way), leaving the GEMM a plain int8 product with one
scale per output channel (`StaticInt8Layers`).

    python -m bench.sam_fp8_sensitivity --images .benchdata/images --photos 7
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.common import DEFAULT_IMAGES, environment, print_table, write_json
from bench.fp8_sensitivity import QuantizedLayers
from models.fidelity import (
    FidelityPrompt,
    SamOutputs,
    SamRunner,
    compare_sam,
    eager_sam_runner,
    fidelity_prompts,
    load_photos,
)
from models.mlp_static import input_amax
from models.sam import SAM_CONFIGS, Sam, load_sam

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# a variant: which of each block's Linear layers run in fp8 (the names under blocks.<i>.)
KINDS = {
    "all": ("attn.qkv", "attn.proj", "mlp.lin1", "mlp.lin2"),
    "attention": ("attn.qkv", "attn.proj"),
    "qkv": ("attn.qkv",),
    "proj": ("attn.proj",),
    "mlp": ("mlp.lin1", "mlp.lin2"),
    "lin1": ("mlp.lin1",),
    "lin2": ("mlp.lin2",),
}


def layer_names(model: Sam, kinds: Sequence[str], skip_ends: bool) -> list[str]:
    """The encoder's block Linear layers of these kinds (`skip_ends`: not in the first or
    the last block, which a per-layer choice would keep in float first)."""
    blocks = len(model.image_encoder.blocks)
    ends = {0, blocks - 1} if skip_ends else set()
    return [
        f"image_encoder.blocks.{i}.{kind}" for i in range(blocks) if i not in ends for kind in kinds
    ]


def calibrate(model: Sam, names: Sequence[str], photos: Sequence[Tensor]) -> dict[str, Tensor]:
    """Each named layer's largest input magnitude per input channel, over `photos` run
    through `model` (fp32, its encoder and decoder as the fidelity check runs them)."""
    runner = eager_sam_runner(model, DEVICE)

    def run() -> list[object]:
        return [runner(p, fidelity_prompts(int(p.shape[0]), int(p.shape[1]))) for p in photos]

    return input_amax(model, run, names)


class StaticInt8Layers:
    """The named Linear layers computed in int8 with fixed activation scales while inside
    the block: per input channel (`per_channel`; folded into the weight's columns before
    the weight is quantised per output channel) or one for the layer, from `amax`. The
    arithmetic a fused kernel would run: x rounded by its fixed scales and clamped to
    +-127 (inputs past the calibration saturate), an exact int32 product, one scale per
    output channel, the bias."""

    def __init__(
        self, model: Sam, names: Sequence[str], amax: dict[str, Tensor], per_channel: bool
    ) -> None:
        self.hooks: list[Any] = []
        self.plan: list[tuple[torch.nn.Module, Tensor, Tensor, Tensor, Tensor | None]] = []
        for name, module in model.named_modules():
            if name not in set(names):
                continue
            peak = amax[name] if per_channel else amax[name].max().expand_as(amax[name])
            x_scale = torch.clamp(peak, min=1e-8) / 127.0  # [K]
            folded = module.weight.detach().float() * x_scale[None, :]
            w_scale = folded.abs().amax(1).clamp(min=1e-12) / 127.0  # [N]
            wq = torch.round(folded / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
            bias = module.bias.detach().float() if isinstance(module.bias, Tensor) else None
            self.plan.append((module, x_scale, wq, w_scale, bias))

    def __enter__(self) -> StaticInt8Layers:
        for module, x_scale, wq, w_scale, bias in self.plan:

            def hook(
                mod: torch.nn.Module, inputs: tuple[Tensor, ...], out: Tensor,
                x_scale: Tensor = x_scale, wq: Tensor = wq, w_scale: Tensor = w_scale,
                bias: Tensor | None = bias,
            ) -> Tensor:  # fmt: skip
                x = inputs[0].reshape(-1, x_scale.shape[0]).float()
                xq = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
                y = torch._int_mm(xq, wq.t()).float() * w_scale  # the exact int32 product
                if bias is not None:
                    y = y + bias
                return y.reshape(out.shape).to(out.dtype)

            self.hooks.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def remembered(runner: SamRunner) -> SamRunner:
    """`runner` computed once per photo: the fp32 reference, which every variant meets."""
    seen: dict[int, SamOutputs] = {}

    def run(photo: Tensor, prompts: Sequence[FidelityPrompt]) -> SamOutputs:
        key = id(photo)
        if key not in seen:
            seen[key] = runner(photo, prompts)
        return seen[key]

    return run


def photo_arguments(p: argparse.ArgumentParser) -> None:
    """The photos and weights a fidelity bench on SAM ViT-B takes."""
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--photos", type=int, default=7, help="at most this many, sorted by name")
    p.add_argument("--weights", type=Path, default=None, help="a SAM ViT-B checkpoint")
    p.add_argument(
        "--seed", type=int, default=0, help="random weights' seed without --weights (served: 0)"
    )


def fp32_reference(args: argparse.Namespace, started: float) -> tuple[Sam, list[Tensor], SamRunner]:
    """SAM ViT-B (`args.weights`, else random weights of `args.seed`: the service's is 0) in
    fp32, the photos, and its outputs on them, each computed now: later variants share the
    model. Another seed tells whether a finding is the weights' or the method's."""
    model = load_sam(SAM_CONFIGS["vit_b"], args.weights, seed=args.seed).to(DEVICE).eval()
    photos = load_photos(args.images, args.photos)
    reference = remembered(eager_sam_runner(model, DEVICE))
    for photo in photos:
        reference(photo, fidelity_prompts(int(photo.shape[0]), int(photo.shape[1])))
    print(f"fp32 reference: {time.perf_counter() - started:.0f} s", flush=True)
    return model, photos, reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    photo_arguments(p)
    p.add_argument("--variants", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument(
        "--skip-ends", action="store_true", help="also each variant with blocks 0 and 11 float"
    )
    p.add_argument(
        "--format", choices=["fp8", "int8", "int8-static", "int8-static-tensor"], default="fp8",
        help="int8: the served int8 kernel's; int8-static(-tensor): fixed activation scales",
    )  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    # the reference before any layer is fp8: the model is shared
    model, photos, reference = fp32_reference(args, started)
    candidate = eager_sam_runner(model, DEVICE)
    amax: dict[str, Tensor] = {}
    if args.format.startswith("int8-static"):  # on the photos mirrored: not the measured ones
        every = layer_names(model, KINDS["all"], False)
        amax = calibrate(model, every, [photo.flip(1) for photo in photos])
        print(f"calibrated: {time.perf_counter() - started:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    plan = [(v, False) for v in args.variants]
    plan += [(v, True) for v in args.variants if args.skip_ends]
    for variant, skip_ends in plan:
        names = layer_names(model, KINDS[variant], skip_ends)
        if args.format.startswith("int8-static"):
            per_channel = args.format == "int8-static"
            quantized: Any = StaticInt8Layers(model, names, amax, per_channel)
        else:
            quantized = QuantizedLayers(model, names, args.format)
        with quantized:
            result = compare_sam(reference, candidate, photos)
        rows.append(
            {
                "variant": f"{args.format} {variant}" + (", blocks 1-10" if skip_ends else ""),
                "layers": len(names),
                **result.measures(),
                "at_s": round(time.perf_counter() - started),
            }
        )
        print(rows[-1], flush=True)
    cols = ["variant", "layers", "embedding_rel_error", "mask_iou_mean", "mask_iou_min"]
    print_table(rows, [*cols, "score_diff_mean"])
    write_json(
        args.json,
        {"environment": environment(), "args": vars(args) | {"json": None}, "rows": rows},
    )


if __name__ == "__main__":
    main()
