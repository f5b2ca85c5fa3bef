"""`python -m models.fidelity`: the fidelity table of optimised variants, for SAM, SAM 2.1
and Swin, against the fp32 eager model on the same weights and photos (the measures and
runners are `models.fidelity`'s; this is only the command line).

    python -m models.fidelity --images photos/ --sam-model vit_b --variants bf16 bf16-int8
    python -m models.fidelity --images photos/ --sam-model sam2.1_hiera_large --swin-model none \\
        --variants bf16 fp16

SAM 2 takes precision variants only: int8, fp8 and 2:4 on its encoder are measured by
`python -m bench.sam2_quant` (slower and less faithful than bf16; the service refuses them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from models.fidelity import (
    compare_sam,
    compare_swin,
    eager_sam2_runner,
    eager_sam_runner,
    eager_swin_runner,
    load_photos,
    swin_views,
)
from models.optimize import DTYPES, OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.sam import SAM_CONFIGS, load_sam
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.swin import SWIN_CONFIGS, load_swin


def _variant_options(
    name: str, compile_mode: str, attention: str, backend: str = "core"
) -> OptimizeOptions:
    """`fp32`, `bf16` or `fp16`, optionally `-int8`, `-fp8` or `-2:4` (e.g. `bf16-int8`)."""
    precision, *rest = name.split("-")
    extra = rest[0] if len(rest) == 1 else "none"
    if precision not in DTYPES or len(rest) > 1 or extra not in ("none", "int8", "fp8", "2:4"):
        raise ValueError(f"unknown variant {name!r}: fp32|bf16|fp16[-int8|-fp8|-2:4]")
    return OptimizeOptions(
        precision=precision,  # type: ignore[arg-type]
        quantization=extra if extra in ("int8", "fp8") else "none",  # type: ignore[arg-type]
        quantization_backend=backend,  # type: ignore[arg-type]
        sparsity="2:4" if extra == "2:4" else "none",
        attention=attention,  # type: ignore[arg-type]
        window_attention="triton" if attention == "triton" else "sdpa",
        compile_mode=compile_mode,  # type: ignore[arg-type]
    )


def _format(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _table(rows: list[dict[str, object]]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_format(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def _sam2_rows(
    args: argparse.Namespace,
    options: dict[str, OptimizeOptions],
    photos: list[torch.Tensor],
    device: torch.device,
) -> list[dict[str, object]]:
    """SAM 2's rows: each precision against fp32, eagerly or with `Sam2.encode` compiled,
    both run as Meta's predictor runs them (`eager_sam2_runner`)."""
    changed = [n for n, o in options.items() if o.quantization != "none" or o.sparsity != "none"]
    if changed:
        raise ValueError(
            f"{', '.join(changed)}: SAM 2 takes precision variants here (fp32, bf16, fp16); "
            "its int8, fp8 and 2:4 are measured by python -m bench.sam2_quant"
        )
    config = SAM2_CONFIGS[args.sam_model]
    fp32 = load_sam2(config, args.sam_checkpoint, seed=args.seed).to(device)
    reference = eager_sam2_runner(fp32, device)
    rows: list[dict[str, object]] = []
    for name, opts in options.items():
        model = load_sam2(config, args.sam_checkpoint, seed=args.seed).to(device, opts.dtype)
        if args.compile:
            model.encode = torch.compile(model.encode, dynamic=False)  # type: ignore[method-assign]
        result = compare_sam(reference, eager_sam2_runner(model, device), photos)
        rows.append({"model": args.sam_model, "variant": name, **asdict(result)})
        print(rows[-1], file=sys.stderr, flush=True)
        del model
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m models.fidelity",
        description="Fidelity of optimised variants against the fp32 eager model on the same "
        "weights and real photos (SAM and SAM 2: embedding error, mask IoU, score "
        "difference; Swin: top-1 agreement, logit error). Eager unless --compile.",
    )
    p.add_argument("--images", type=Path, required=True, help="a folder of .jpg/.png photos")
    p.add_argument("--max-photos", type=int, default=None)
    p.add_argument("--variants", nargs="+", default=["bf16", "bf16-int8", "bf16-fp8"])
    sam_names = [*SAM_CONFIGS, *SAM2_CONFIGS, "none"]
    p.add_argument("--sam-model", default="vit_b", choices=sam_names)
    p.add_argument("--sam-checkpoint", type=Path, default=None)
    p.add_argument("--swin-model", default="swin_tiny_patch4_window7_224",
                   choices=[*SWIN_CONFIGS, "none"])  # fmt: skip
    p.add_argument("--swin-checkpoint", type=Path, default=None)
    p.add_argument("--swin-views", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (no checkpoint)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile each variant first")
    p.add_argument(
        "--attention",
        choices=["sdpa", "flex", "triton"],
        default=None,
        help="SAM encoder attention (default: triton on CUDA, sdpa on the CPU)",
    )
    p.add_argument(
        "--quantization-backend",
        choices=["core", "int_mm", "torchao"],
        default="core",
        help="int8/fp8 through our layers (core; int_mm: torch._int_mm, every layer) or torchao",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    attention = args.attention or ("triton" if device.type == "cuda" else "sdpa")
    compile_mode = "default" if args.compile else "none"
    try:
        options = {
            v: _variant_options(v, compile_mode, attention, args.quantization_backend)
            for v in args.variants
        }
        photos = load_photos(args.images, args.max_photos)
    except ValueError as exc:
        p.error(str(exc))
    rows: list[dict[str, object]] = []
    if args.sam_model in SAM2_CONFIGS:
        try:
            rows += _sam2_rows(args, options, photos, device)
        except ValueError as exc:
            p.error(str(exc))
    elif args.sam_model != "none":
        config = SAM_CONFIGS[args.sam_model]
        reference = load_sam(config, args.sam_checkpoint, seed=args.seed).to(device)
        ref_run = eager_sam_runner(reference, device)
        for name, opts in options.items():
            model = load_sam(config, args.sam_checkpoint, seed=args.seed).to(device, opts.dtype)
            prepare_sam_encoder(model.image_encoder, opts, device)
            if args.compile:
                model.image_encoder = torch.compile(model.image_encoder, dynamic=False)  # type: ignore[assignment]
            result = compare_sam(ref_run, eager_sam_runner(model, device), photos)
            rows.append({"model": f"sam_{args.sam_model}", "variant": name, **asdict(result)})
            print(rows[-1], file=sys.stderr, flush=True)
            del model
    if args.swin_model != "none":
        swin_config = SWIN_CONFIGS[args.swin_model]
        views = swin_views(photos, args.swin_views)
        swin_ref = load_swin(swin_config, args.swin_checkpoint, seed=args.seed).to(device)
        swin_ref_run = eager_swin_runner(swin_ref, swin_config, device)
        for name, opts in options.items():
            if opts.sparsity != "none":
                continue  # 2:4 sparsity is for SAM's encoder MLPs only
            swin = load_swin(swin_config, args.swin_checkpoint, seed=args.seed)
            swin = swin.to(device, opts.dtype)
            prepare_swin(swin, opts)
            if args.compile:
                swin = torch.compile(swin, dynamic=False)  # type: ignore[assignment]
            swin_result = compare_swin(
                swin_ref_run, eager_swin_runner(swin, swin_config, device), views
            )
            rows.append({"model": args.swin_model, "variant": name, **asdict(swin_result)})
            print(rows[-1], file=sys.stderr, flush=True)
    random = args.sam_checkpoint is None and args.swin_checkpoint is None
    weights = "random weights" if random else "checkpoints"
    print(f"{device}, torch {torch.__version__}, {len(photos)} photos, {weights}")
    for served in dict.fromkeys(str(row["model"]) for row in rows):
        print(_table([row for row in rows if row["model"] == served]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
