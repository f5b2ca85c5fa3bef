"""Swin classifier throughput, memory and top-1 agreement with fp32, variant by variant.

Inputs for agreement are real photos (random crops and flips of them, pre-processed by the
service's own transform), so the variants are compared on the same images the fp32 eager
model sees. Random weights give small logit margins, which makes agreement harder to keep
than with trained weights.

    python -m bench.swin --images ../shared/data/images --batch-sizes 64 256 512

int8 (issue 20): `bf16-int8-compile` is the earlier torch._int_mm path, `bf16-int8fused-compile`
the fused Triton kernel on every block Linear (weights rounded to nearest),
`bf16-int8fused-gptq-compile` the same calibrated (GPTQ rounding, bias correction), and
`bf16-int8fused-select-compile` that with the per-layer choice (the worst-measured layers
kept in bf16): what SERVE_QUANTIZATION=int8 serves. fp8 alike: `bf16-fp8-compile` the
earlier `torch._scaled_mm` path, `bf16-fp8fused-compile` the fused kernel on e4m3 operands
(models.fp8_gemm) on every block Linear, `bf16-fp8fused-select-compile` with the per-layer
choice and bias correction (SERVE_QUANTIZATION=fp8). `-lnq` adds the LayerNorm that writes
qkv's and fc1's input quantised (models.ln_quant; OptimizeOptions.norm_quant), `-lnq-hop`
also fc1's output handed to fc2 quantised (models.mlp_hop; OptimizeOptions.mlp_hop).
One run:

    python3 -m bench.swin --static --batch-sizes 256 --iters 10 --agreement-images 512 \
        --variants bf16-compile bf16-int8fused-select-compile bf16-int8fused-select-lnq-compile \
        bf16-int8fused-select-lnq-hop-compile bf16-fp8fused-select-compile \
        bf16-fp8fused-select-lnq-compile bf16-fp8fused-select-lnq-hop-compile
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    DEFAULT_IMAGES,
    cuda_time_ms,
    empty_cache,
    environment,
    load_photos,
    peak_gib,
    print_table,
    reset_peak,
    write_json,
)
from models import gemm_persistent
from models.fidelity import swin_views
from models.int8_select import calibration_run
from models.ln_quant import QuantizingLayerNorm
from models.optimize import GraphedBuckets, OptimizeOptions, compile_fn, prepare_swin
from models.quantize import DynamicQuantLinear, Fp8RowwiseLinear, quantize_linears
from models.swin import SWIN_CONFIGS, WindowAttention, load_swin
from models.swin import transforms as swin_tf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

VARIANTS: dict[str, OptimizeOptions] = {
    "fp32-eager": OptimizeOptions(),
    "bf16-eager": OptimizeOptions(precision="bf16"),
    "bf16-compile": OptimizeOptions(precision="bf16", compile_mode="default", cuda_graphs=True),
    "fp16-compile": OptimizeOptions(precision="fp16", compile_mode="default", cuda_graphs=True),
    # GELU in fc1's cuBLASLt epilogue (models.quantize.GeluLinear)
    **{
        f"{dtype}-gelu-compile": OptimizeOptions(
            precision=dtype, compile_mode="default", cuda_graphs=True, gelu_epilogue=True
        )
        for dtype in ("bf16", "fp16")
    },
    # int8, every block Linear, through torch._int_mm then the epilogue (the earlier path)
    "bf16-int8-compile": OptimizeOptions(
        precision="bf16",
        quantization="int8",
        quantization_backend="int_mm",
        compile_mode="default",
        cuda_graphs=True,
    ),
    # int8 through the fused Triton kernel (models.int8_gemm), every block Linear
    "bf16-int8fused-compile": OptimizeOptions(
        precision="bf16", quantization="int8", compile_mode="default", cuda_graphs=True
    ),
    # ... eager (no compiler: the kernel called as the model runs), every block Linear
    "bf16-int8fused-eager": OptimizeOptions(precision="bf16", quantization="int8"),
    # ... calibrated (8 smooth_images): GPTQ rounding and bias correction, every layer
    "bf16-int8fused-gptq-compile": OptimizeOptions(
        precision="bf16", quantization="int8", compile_mode="default", cuda_graphs=True
    ),
    # ... and the per-layer choice (models.int8_select): what SERVE_QUANTIZATION=int8 serves
    "bf16-int8fused-select-compile": OptimizeOptions(
        precision="bf16", quantization="int8", compile_mode="default", cuda_graphs=True
    ),
    # fp8 through torch._scaled_mm, every block Linear (the earlier path)
    "bf16-fp8-compile": OptimizeOptions(
        precision="bf16",
        quantization="fp8",
        quantization_backend="int_mm",
        compile_mode="default",
        cuda_graphs=True,
    ),
    **{
        f"bf16-{kind}fused{how}{lnq}-compile": OptimizeOptions(
            precision="bf16",
            quantization=kind,  # type: ignore[arg-type]
            compile_mode="default",
            cuda_graphs=True,
            norm_quant=bool(lnq),
            mlp_hop="hop" in lnq,
        )
        for kind in ("int8", "fp8")
        for how in ("", "-gptq", "-select")
        for lnq in ("", "-lnq", "-lnq-hop")
        if (kind == "fp8" or lnq) and not (kind == "fp8" and how == "-gptq")
    },
    # what SERVE_QUANTIZATION=int8 / fp8 serve on CUDA now: the layers the choice keeps in
    # float take GELU in their epilogue too (SERVE_MLP_GELU=auto)
    # (fp16: the same, the float parts in fp16, whose 10-bit mantissa keeps Swin's labels
    # where bf16's 7 bits move some: 99.9% against 99.3% top-1 on an H100, 2026-11-27)
    **{
        f"{dtype}-{kind}fused-select-lnq-gelu-compile": OptimizeOptions(
            precision=dtype,  # type: ignore[arg-type]
            quantization=kind,  # type: ignore[arg-type]
            compile_mode="default",
            cuda_graphs=True,
            norm_quant=True,
            gelu_epilogue=True,
        )
        for kind in ("int8", "fp8")
        for dtype in ("bf16", "fp16")
    },
    "bf16-autotune": OptimizeOptions(
        precision="bf16", compile_mode="max-autotune-no-cudagraphs", cuda_graphs=True
    ),
    "fp16-autotune": OptimizeOptions(
        precision="fp16", compile_mode="max-autotune-no-cudagraphs", cuda_graphs=True
    ),
}


# variants whose int8/fp8 takes every candidate layer (prepare_swin would measure and
# choose): uncalibrated (rounded to nearest), or calibrated as prepare_swin does but keeping
# none
EVERY_LAYER = {
    f"bf16-{kind}fused{how}{lnq}-compile": how == "-gptq"
    for kind in ("int8", "fp8")
    for how in ("", "-gptq")
    for lnq in ("", "-lnq", "-lnq-hop")
    if not (kind == "fp8" and how == "-gptq")
} | {"bf16-int8fused-eager": False}


def _block_linear(name: str, layer: torch.nn.Linear) -> bool:
    return name.startswith("layers.") and ".blocks." in name  # prepare_swin's candidates


def prepare(model: torch.nn.Module, variant: str, opts: OptimizeOptions) -> None:
    """`prepare_swin`, or for `EVERY_LAYER` the same without the per-layer choice."""
    if variant not in EVERY_LAYER:
        prepare_swin(model, opts)
        return
    prepare_swin(model, replace(opts, quantization="none"))
    calibrate = calibration_run(model.config.img_size, 8) if EVERY_LAYER[variant] else None
    quantize_linears(model, opts.quantization, _block_linear, backend=opts.quantization_backend,
                     calibrate=calibrate, max_kept=0.0, norm_quant=opts.norm_quant,
                     mlp_hop=opts.mlp_hop)  # fmt: skip


def agreement_inputs(photos: list[torch.Tensor], n: int, config) -> torch.Tensor:
    """`n` pre-processed views: seeded crops (40-100% of a side) and flips of the photos,
    the same views the service's fidelity check uses (`models.fidelity.swin_views`)."""
    return swin_tf.preprocess_images(swin_views(photos, n), config, DEVICE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="swin_tiny_patch4_window7_224", choices=list(SWIN_CONFIGS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 256, 512])
    p.add_argument("--agreement-images", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--static", action="store_true", help="compile per batch size, not dynamic")
    p.add_argument(
        "--attention",
        nargs="+",
        choices=["auto", "kernel", "matmul", "sdpa"],
        default=["auto"],
        help="window attention as the service runs it (auto: the kernel on CUDA), as one\n"
        "Triton kernel (models.swin.window_kernel), written out, or through SDPA\n"
        "(WindowAttention.form); each variant runs once per form",
    )
    p.add_argument(
        "--emulate-casts",
        action="store_true",
        help="inductor rounds fused intermediates to the dtype eager would hold\n"
        "(emulate_precision_casts): the compiled int8 fault's suspect (docs/BENCHMARKS.md)",
    )
    p.add_argument(
        "--int8-gemm", choices=["auto", "tiled", "persistent"], default="auto",
        help="the int8/fp8 layers' kernel: models/gemm_persistent.py (auto: on Hopper, the\n"
        "shapes it was measured on) or the tile-per-program models/gemm_kernel.py",
    )  # fmt: skip
    args = p.parse_args()
    gemm_persistent.ENABLED = {"auto": None, "tiled": False, "persistent": True}[args.int8_gemm]
    if args.emulate_casts:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    started = time.perf_counter()
    env = environment()
    print(env, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    config = SWIN_CONFIGS[args.model]
    base = load_swin(config, None, seed=0).to(DEVICE)
    inputs = agreement_inputs(load_photos(args.images), args.agreement_images, config)
    with torch.inference_mode():
        ref_top1 = torch.cat(
            [base(inputs[i : i + 64]).argmax(-1) for i in range(0, len(inputs), 64)]
        )
    rows: list[dict[str, Any]] = []
    for variant, attention in [(v, a) for v in args.variants for a in args.attention]:
        name = variant if attention == "auto" else f"{variant}, attention {attention}"
        if time.perf_counter() - started > args.budget_s:
            print(f"budget spent: skipping {name}", flush=True)
            continue
        opts = VARIANTS[variant]
        try:
            model = copy.deepcopy(base).to(dtype=opts.dtype)
            prepare(model, variant, opts)
            quantised = (DynamicQuantLinear, Fp8RowwiseLinear)
            quant_layers = sum(isinstance(m, quantised) for m in model.modules())
            lnq_norms = sum(isinstance(m, QuantizingLayerNorm) for m in model.modules())
            hops = sum(getattr(m, "hop_out", False) for m in model.modules())
            for module in model.modules():
                if isinstance(module, WindowAttention):
                    module.form = attention
            fn = GraphedBuckets(
                compile_fn(model, opts.compile_mode, dynamic=not args.static),
                enabled=opts.cuda_graphs,
            )
            side = config.img_size
            compile_s = None
            with torch.inference_mode():
                for bs in args.batch_sizes:
                    x = torch.randn(bs, 3, side, side, device=DEVICE, dtype=opts.dtype)
                    reset_peak()  # the peak includes the graph's pool
                    t0 = time.perf_counter()
                    fn.capture(x)
                    compile_s = compile_s or time.perf_counter() - t0
                    ms = cuda_time_ms(partial(fn, x), args.iters)
                    rows.append(
                        {
                            "variant": name,
                            "batch": bs,
                            "img_per_s": bs * 1000 / ms,
                            "ms": ms,
                            "peak_gib": peak_gib(),
                            "compile_s": compile_s,
                            "quant_layers": quant_layers,
                            "lnq_norms": lnq_norms,
                            "hops": hops,
                        }
                    )
                    print(rows[-1], flush=True)
                step = max(args.batch_sizes)
                top1 = []
                for i in range(0, len(inputs), step):
                    part = inputs[i : i + step].to(opts.dtype)
                    n = part.shape[0]
                    if n < step:
                        part = torch.cat([part, part.new_zeros(step - n, *part.shape[1:])])
                    top1.append(fn(part)[:n].argmax(-1).clone())
            agree = float((torch.cat(top1) == ref_top1).float().mean())
            for row in rows:
                if row["variant"] == name:
                    row["top1_agree"] = agree
        except Exception as exc:  # one broken variant must not lose the others
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        torch._dynamo.reset()
        empty_cache()
    write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    print(
        f"\n{env['device']}, torch {env['torch']}, {env['date']}, {args.model}, "
        f"top-1 agreement on {len(inputs)} views of real photos"
    )
    print_table(
        rows,
        [
            "variant",
            "batch",
            "img_per_s",
            "ms",
            "peak_gib",
            "compile_s",
            "quant_layers",
            "lnq_norms",
            "hops",
            "top1_agree",
            "error",
        ],
    )


if __name__ == "__main__":
    main()
