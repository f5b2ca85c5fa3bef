"""SAM image-encoder throughput, memory and fidelity, variant by variant, on one GPU.

Every variant runs our ViT encoder on the same seeded random weights; its embeddings of
real photos are compared with the fp32 eager embeddings (relative error), and masks
decoded from them (one box per photo, fp32 decoder) with the fp32 masks (IoU). Meta's
official encoder runs in the same process as the baseline.

    python -m bench.sam_encoder --images ../shared/data/images \
        --variants bf16-eager bf16-compile-flex bf16-fp8-compile-flex --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
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
from models import gemm_gluon, gemm_persistent, int8_select, ln_quant, quantize
from models.aot import AotBuckets, AotStore, PackageKey, weights_hash
from models.fidelity import mask_iou, relative_error
from models.optimize import GraphedBuckets, OptimizeOptions, compile_fn, prepare_sam_encoder
from models.sam import SAM_CONFIGS, PromptSet, Sam, fused_attention, load_sam, pack_prompts
from models.sam import transforms as tf
from models.sam.image_encoder import Block

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run


def _variant(name: str) -> OptimizeOptions:
    """`bf16[-gelu][-int8|-fp8|-2:4][-torchao|-int_mm][-lnq][-hop|-static][-pres][-pstatic]-(eager|compile|autotune|aot)[-sdpa|-flex|-triton][-win][-parted]`,
    e.g. bf16-fp8-compile-triton; `-torchao` quantizes through torchao instead of our layers,
    `-int_mm` through the earlier torch paths on every layer (int8: torch._int_mm, fp8:
    torch._scaled_mm; the fused kernels with the per-layer choice are the default), `-lnq`
    the LayerNorm writing qkv's and lin1's input quantised (models.ln_quant), `-hop` lin1's
    output handed to lin2 quantised (models.mlp_hop), `-static` by fixed per-channel scales
    calibrated at load (models.mlp_static), `-pres` the attention's residual added in
    proj's epilogue (`Block.residual_in_proj`), `-gelu` GELU in lin1's cuBLASLt
    epilogue (models.quantize.GeluLinear, what the service runs on CUDA). The switches
    `runtime_knobs` reads (`-dense`, `-pad128`, `-x2`, `-lnRxW`, `-gluon`, `-gattn`, `-gwin`,
    `-pingpong`, `-kept0`, `-pwindowed`, `-pglobal`, `-phP`, `-leaves`, `-smooth`) may
    follow."""
    parts = name.split("-")
    quant = next((q for q in ("int8", "fp8") if q in parts), "none")
    mode = {
        "eager": "none",
        "compile": "default",
        "autotune": "max-autotune-no-cudagraphs",
        "aot": "aot",  # an AOTInductor package built here (models.aot), as the service's
    }
    compile_mode = next(mode[p] for p in parts if p in mode)
    return OptimizeOptions(
        precision=parts[0],  # type: ignore[arg-type]
        quantization=quant,  # type: ignore[arg-type]
        quantization_backend=next((b for b in ("torchao", "int_mm") if b in parts), "core"),
        sparsity="2:4" if "2:4" in parts else "none",
        attention=next((a for a in ("flex", "triton") if a in parts), "sdpa"),  # type: ignore[arg-type]
        window_attention="triton" if "win" in parts else "sdpa",
        compile_mode=compile_mode,  # type: ignore[arg-type]
        cuda_graphs=compile_mode != "none",
        norm_quant="lnq" in parts,
        mlp_hop="hop" in parts,
        mlp_static="static" in parts,
        proj_residual="pres" in parts,
        proj_static="pstatic" in parts,
        gelu_epilogue="gelu" in parts,
    )


VARIANTS: dict[str, OptimizeOptions] = {
    name: _variant(name)
    for name in [
        "fp32-eager",
        "bf16-eager",
        *(
            f"bf16{q}-{mode}-{attn}"
            for q in ("", "-int8", "-fp8", "-2:4")
            for mode in ("compile", "autotune")
            for attn in ("sdpa", "flex", "triton")
        ),
        "bf16-eager-triton",
        "bf16-compile-triton-win",
        "bf16-gelu-compile-triton-win",  # GELU in lin1's cuBLASLt epilogue
        "bf16-gelu-compile-triton-win-parted",  # ... the windows partitioned, not in place
        "bf16-gelu-int8-lnq-compile-triton-win",  # SERVE_QUANTIZATION=int8 on CUDA now
        "bf16-gelu-int8-lnq-static-compile-triton-win",  # lin2's input by fixed scales
        "bf16-gelu-int8-lnq-static-compile-triton-win-parted",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win",  # proj adds the residual
        # `runtime_knobs`' switches, each beside the variant it changes
        "bf16-gelu-compile-triton-win-dense",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-dense",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-ln1x1",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-ln2x2",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-ln8x8",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-pad128",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-x2",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-pad128-x2",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gattn",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-pingpong",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-kept0",
        # the output projections' input by fixed scales, written int8 by the attention
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-pwindowed",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-pglobal",
        # ... at lin2's headroom, 1.5x (the projections' is 3x: quantize.PROJ_HEADROOM)
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-ph150",
        # ... calibrated on the photos mirrored (SERVE_CALIBRATION_IMAGES), not 8 smooth images
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-calphotos",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-calphotos",
        # ... on 8 dead-leaves images (served since 2026-12-07, int8_select.SYNTHETIC) or on
        # 8 smooth ones (served before; every earlier row without -leaves ran so)
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-leaves",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-kept0-leaves",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-leaves",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-ph150-leaves",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn-gwin-smooth",
        "bf16-gelu-int8-lnq-static-pres-pstatic-compile-triton-win-gluon-gattn-gwin-kept0-smooth",
        "bf16-gelu-int8-lnq-static-pres-compile-triton-win-gwin",
        "bf16-gelu-compile-triton-win-gattn",
        "bf16-gelu-compile-triton-win-gattn-gwin",
        "bf16-fp8-compile-triton-win",
        "bf16-int8-compile-triton-win",
        "bf16-int8-int_mm-compile-triton-win",  # torch._int_mm, every layer (issue 20's before)
        "bf16-fp8-int_mm-compile-triton-win",  # torch._scaled_mm, every layer (the same)
        "bf16-int8-lnq-compile-triton-win",  # the norm writes the quantised rows
        "bf16-fp8-lnq-compile-triton-win",
        "bf16-int8-lnq-hop-compile-triton-win",  # and lin1's output handed to lin2 quantised
        "bf16-fp8-lnq-hop-compile-triton-win",
        "bf16-int8-torchao-compile-triton-win",
        "bf16-fp8-torchao-compile-triton-win",
        "bf16-gelu-aot-sdpa",  # SERVE_COMPILE_MODE=aot's default
        "bf16-gelu-aot-triton-win",  # ... with SERVE_ATTENTION=triton: the kernel packaged
    ]
}


# `-x2`: two persistent-GEMM programs an SM, 4 warps on 128x128 tiles in K steps of 64 (the
# fastest paired shape on contiguous rows, docs/BENCHMARKS.md, issue 20, eighteenth session)
PAIRED = gemm_persistent.PersistentConfig(128, 128, 64, 4, 4, True, programs_per_sm=2)


@contextlib.contextmanager
def runtime_knobs(name: str) -> Iterator[None]:
    """A variant's switches that live in module globals and are read at each launch, set for
    the whole of its run (compile, capture, timing, fidelity) and put back after, so that
    variants with and without them compare in one process on one machine: `-dense` the
    global attention's key rows without masks (`fused_attention.DENSE_ROWS`), `-pad128` the
    quantising norms' rows 128 bytes longer, so each lies 128-byte aligned
    (`ln_quant.PACK_PAD`), `-x2` every int8 layer in `PAIRED` (`gemm_persistent.SERVED`),
    `-lnRxW` the quantising norm's launch in R rows a program and W warps
    (`ln_quant.SHAPE`), `-gluon` the int8 products through the warp-specialised Gluon
    kernel (`gemm_persistent.GLUON`), `-gattn` the global attention through the Gluon
    kernel (`fused_attention.GLUON_GLOBAL`), `-gwin` the windowed attention through the
    Gluon window kernel (`fused_attention.GLUON_WINDOW`), `-pingpong` every Gluon GEMM in
    its ping-pong form, none in the cooperative one (`gemm_gluon.COOPERATIVE`), `-kept0` no
    layer kept in float by the per-layer choice (`quantize.INT8_MAX_KEPT`: what the six
    float lin2 cost and buy), `-pwindowed` / `-pglobal` `-pstatic` on those blocks'
    projections only (`quantize.PROJ_STATIC_BLOCKS`), `-phP` their scales' headroom P% of
    the calibration's peaks (`quantize.PROJ_HEADROOM`), `-leaves` / `-smooth` calibrated on
    dead-leaves or smooth images (`int8_select.SYNTHETIC`; unnamed, SAM's own: leaves since
    2026-12-07, smooth in the rows before).

    The pad changes the quantising norm's output width, which the compiled graph's size
    asserts hold; inductor's and AOT autograd's caches key the graph, not its custom ops'
    fake outputs, so a padded variant would load the unpadded variant's code (seen on the
    H200: `stride 896==784`). Every compile cache is off for such a variant's run
    (`force_disable_caches`, which no `TORCHINDUCTOR_FX_GRAPH_CACHE` in the environment
    overrides, as it does inductor's own switch: the engine's build sets it)."""
    parts = name.split("-")
    saved = (fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED,
             ln_quant.SHAPE, gemm_persistent.GLUON, fused_attention.GLUON_GLOBAL,
             fused_attention.GLUON_WINDOW, gemm_gluon.COOPERATIVE,
             quantize.INT8_MAX_KEPT, quantize.PROJ_STATIC_BLOCKS,
             quantize.PROJ_HEADROOM, int8_select.SYNTHETIC)  # fmt: skip
    fused_attention.DENSE_ROWS = "dense" in parts
    for blocks in ("windowed", "global"):
        if f"p{blocks}" in parts:
            quantize.PROJ_STATIC_BLOCKS = blocks
    if "kept0" in parts:
        quantize.INT8_MAX_KEPT = 0.0
    for kind in ("leaves", "smooth"):
        if kind in parts:
            int8_select.SYNTHETIC = kind
    gemm_gluon.COOPERATIVE = "pingpong" not in parts
    gemm_persistent.GLUON = "gluon" in parts
    fused_attention.GLUON_GLOBAL = "gattn" in parts
    fused_attention.GLUON_WINDOW = "gwin" in parts
    for part in parts:
        if shape := re.fullmatch(r"ln(\d+)x(\d+)", part):
            ln_quant.SHAPE = int(shape[1]), int(shape[2])
        if headroom := re.fullmatch(r"ph(\d+)", part):  # percent: ph75 is 0.75
            quantize.PROJ_HEADROOM = int(headroom[1]) / 100
    caches = contextlib.ExitStack()
    if "pad128" in parts:
        ln_quant.PACK_PAD = 128
        no_caches = torch.compiler.config.patch(force_disable_caches=True)  # type: ignore[attr-defined]
        caches.enter_context(no_caches)
    if "x2" in parts:
        gemm_persistent.SERVED = PAIRED
    try:
        with caches:
            yield
    finally:
        (fused_attention.DENSE_ROWS, ln_quant.PACK_PAD, gemm_persistent.SERVED,
         ln_quant.SHAPE, gemm_persistent.GLUON, fused_attention.GLUON_GLOBAL,
         fused_attention.GLUON_WINDOW, gemm_gluon.COOPERATIVE,
         quantize.INT8_MAX_KEPT, quantize.PROJ_STATIC_BLOCKS,
         quantize.PROJ_HEADROOM, int8_select.SYNTHETIC) = saved  # fmt: skip


def fidelity_inputs(photos: list[torch.Tensor], model: Sam) -> tuple[torch.Tensor, list, Any]:
    """The photos pre-processed once, and one central box prompt per photo."""
    config = model.config
    batch, input_sizes = tf.preprocess_images(photos, config, DEVICE)
    sets = []
    for photo in photos:
        h, w = photo.shape[:2]
        box = torch.tensor([[w * 0.25, h * 0.25], [w * 0.75, h * 0.75]])
        sets.append(PromptSet(box=tf.scale_coords(box, (h, w), config).reshape(4)))
    prompts = pack_prompts(sets, list(range(len(photos))), DEVICE)
    return batch, input_sizes, prompts


def masks_of(
    model: Sam, embeddings: torch.Tensor, prompts: Any, sizes, photos
) -> list[torch.Tensor]:
    low_res, _ = model.decode(embeddings.float(), prompts)
    out = []
    for k, photo in enumerate(photos):
        logits = tf.postprocess_masks(
            low_res[k : k + 1, :1].float(), sizes[k], photo.shape[:2], model.config
        )
        out.append(logits[0] > 0)
    return out


def official_baseline(batch_sizes: list[int], iters: int) -> list[dict[str, Any]]:
    """Meta's own encoder (random init), fp32 and bf16 eager, as published."""
    from segment_anything import sam_model_registry

    encoder = sam_model_registry["vit_b"]().image_encoder.cuda().eval()
    rows = []
    for dtype, name in (
        (torch.float32, "official-fp32-eager"),
        (torch.bfloat16, "official-bf16-eager"),
    ):
        enc = copy.deepcopy(encoder).to(dtype)
        for bs in batch_sizes:
            if dtype == torch.float32 and bs > 8:
                continue
            x = torch.randn(bs, 3, 1024, 1024, device=DEVICE, dtype=dtype)
            reset_peak()
            with torch.inference_mode():
                ms = cuda_time_ms(partial(enc, x), iters)
            rows.append(
                {
                    "variant": name,
                    "batch": bs,
                    "img_per_s": bs * 1000 / ms,
                    "ms": ms,
                    "peak_gib": peak_gib(),
                }
            )
    empty_cache()
    return rows


# The photos mirrored left to right, pre-processed as the service does (set by `main`): what
# `-calphotos` variants calibrate on, as SERVE_CALIBRATION_IMAGES would give photos like the
# served ones (bench/sam_static_calibration.py's "the photos mirrored" rows)
CALIBRATION: torch.Tensor | None = None


def prepared(name: str, base: Sam) -> tuple[OptimizeOptions, Sam]:
    """A copy of `base` prepared as the variant says; `-parted`: the windowed blocks on
    partitioned windows (Meta's way: padded, projected, attended, cropped) where the
    service reads them in place on the Triton kernel (`prepare_sam_encoder`). On an H200,
    the kernel taking the padding's bias by its constants: in place bf16 437.8 against
    421.0 img/s at batch 8, int8 472.8 against 466.0 (docs/BENCHMARKS.md, issue 20,
    seventeenth session)."""
    opts = VARIANTS[name]
    model = copy.deepcopy(base).to(dtype=opts.dtype)
    calibration = None
    if "calphotos" in name.split("-"):
        if CALIBRATION is None:  # never the synthetic images under this name
            raise RuntimeError(f"{name}: no photos to calibrate on (bench.sam_encoder.CALIBRATION)")
        calibration = CALIBRATION.to(opts.dtype)
    prepare_sam_encoder(model.image_encoder, opts, torch.device(DEVICE), calibration)
    if "parted" in name.split("-"):
        for block in model.image_encoder.blocks:
            if isinstance(block, Block):
                block.windows_in_place = False
    return opts, model


def run_variant(
    static: bool, name: str, base: Sam, photos, fid, ref_embed, ref_masks, batch_sizes, iters
) -> list[dict[str, Any]]:
    opts, model = prepared(name, base)
    if opts.compile_mode == "aot":
        # one package with a dynamic batch, built into a fresh folder (its build time is
        # the first batch size's prepare_s), as `python -m server compile` builds it
        folder = Path(tempfile.mkdtemp(prefix="bench-aot-"))
        atexit.register(shutil.rmtree, folder, True)  # hundreds of MB a package
        key = PackageKey(f"bench_{name}", weights_hash(model.image_encoder), opts.variant, DEVICE)
        encode: Any = AotBuckets(model.image_encoder, AotStore(folder, key), "sam_encoder")
    else:
        encode = compile_fn(model.encode, opts.compile_mode, dynamic=not static)
    fn = GraphedBuckets(encode, enabled=opts.cuda_graphs)
    batch, sizes, prompts = fid
    rows = []
    first_compile_s = None
    side = base.config.image_size
    with torch.inference_mode():
        for bs in batch_sizes:
            x = torch.randn(bs, 3, side, side, device=DEVICE, dtype=opts.dtype)
            reset_peak()  # the peak includes what capture allocates (the graph's pool)
            started = time.perf_counter()
            if isinstance(encode, AotBuckets):
                encode.prepare(x)  # load or build the package first, as the service does
            fn.capture(x)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            prepare_s = time.perf_counter() - started
            if first_compile_s is None:
                first_compile_s = prepare_s
            ms = cuda_time_ms(partial(fn, x), iters)
            peak = peak_gib()
            rows.append(
                {
                    "variant": name,
                    "batch": bs,
                    "img_per_s": bs * 1000 / ms,
                    "ms": ms,
                    "peak_gib": peak,
                    "prepare_s": prepare_s,
                }
            )
            print(rows[-1], flush=True)
        # fidelity on the real photos, in chunks of the largest batch size
        chunks = []
        step = max(batch_sizes)
        for i in range(0, batch.shape[0], step):
            part = batch[i : i + step].to(opts.dtype)
            pad = step - part.shape[0]
            if pad:
                part = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
            chunks.append(fn(part)[: step - pad].float().clone())
        embed = torch.cat(chunks)
        masks = masks_of(base, embed, prompts, sizes, photos)
    err = relative_error(embed, ref_embed)
    ious = torch.cat([mask_iou(a[None], b[None]) for a, b in zip(masks, ref_masks, strict=True)])
    for row in rows:
        row.update(
            embed_rel_err=err,
            mask_iou_mean=float(ious.mean()),
            mask_iou_min=float(ious.min()),
            compile_s=first_compile_s,
        )
    torch._dynamo.reset()
    empty_cache()
    return rows


def profile_variant(name: str, base: Sam, batch: int, out: Path | None) -> None:
    """Where the time goes: the variant compiled without CUDA graphs (so each kernel shows),
    five calls under the profiler, the 40 costliest kernels printed."""
    from torch.profiler import ProfilerActivity, profile

    opts, model = prepared(name, base)
    fn = compile_fn(model.encode, opts.compile_mode, dynamic=False)
    side = base.config.image_size
    x = torch.randn(batch, 3, side, side, device=DEVICE, dtype=opts.dtype)
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(x)
            torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=90
    )
    print(f"profile of {name} at batch {batch} (5 calls):\n{table}", flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
    torch._dynamo.reset()
    empty_cache()


def attention_kernels(batch: int, iters: int) -> list[dict[str, Any]]:
    """One attention layer of ViT-B (12 heads of 64) in every form: a global one (64x64
    grid) and a windowed one (the 25 14x14 windows of each image)."""
    rows = []
    for layer, n_batch, side in (("global", batch, 64), ("window", batch * 25, 14)):
        rows += _attention_layer(layer, n_batch, side, iters)
    return rows


def _attention_layer(layer: str, batch: int, side: int, iters: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from models.sam.attention import flex_rel_pos_attention, rel_pos_attention, rel_pos_terms
    from models.sam.fused_attention import KernelConfig, launch

    g = torch.Generator(device=DEVICE).manual_seed(0)
    n = side * side
    shape = (batch, 12, n, 64)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in "qkv")
    rph = torch.randn(2 * side - 1, 64, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.1
    rpw = torch.randn(2 * side - 1, 64, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.1
    grid = (side, side)
    rel_h, rel_w = rel_pos_terms(q, rph, rpw, side, side)
    flops = 4 * batch * 12 * n * n * 64
    forms = {
        "sdpa-no-bias (floor)": lambda: F.scaled_dot_product_attention(q, k, v),
        "sdpa-dense-bias": lambda: rel_pos_attention(q, k, v, rph, rpw, grid, "sdpa"),
        "triton-fused": lambda: launch(q, k, v, rph, rpw),
    }
    if layer == "global" and os.environ.get("BENCH_FLEX", "1") == "1":
        forms["flex-factors-as-inputs"] = lambda: flex_rel_pos_attention(q, k, v, rel_h, rel_w)
        forms["flex-factors-in-graph"] = lambda: rel_pos_attention(q, k, v, rph, rpw, grid, "flex")
    rows = []
    ref = rel_pos_attention(q, k, v, rph, rpw, grid, "sdpa").float()

    def row(name: str, ms: float, out: torch.Tensor | None) -> None:
        err = relative_error(out.float(), ref) if out is not None else float("nan")
        rows.append(
            {
                "variant": f"attn {layer} {name}",
                "batch": batch,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "rel_err": err,
            }
        )
        print(rows[-1], flush=True)

    for name, fn in forms.items():
        for dynamic in (False, True) if "in-graph" in name else (False,):
            torch._dynamo.reset()
            compiled = torch.compile(fn, dynamic=dynamic)
            with torch.inference_mode():
                out = compiled()
                ms = cuda_time_ms(compiled, iters)
            row(f"{name} dyn={dynamic}", ms, None if "floor" in name else out)
    # the kernel's launch shape, swept: the best one goes into KernelConfig's defaults
    cfg = KernelConfig
    default = (cfg.block_m, cfg.num_warps, cfg.num_stages, dict(cfg.maxnreg))
    # BLOCK_M, warps, stages, a register cap (None: the compiler's choice; 168 lets three
    # programs of 4 warps share an SM). Blocks of several key rows, or a window's 196 keys
    # in one block, were slower in every shape tried (docs/BENCHMARKS.md, issue 20's
    # thirteenth session) and left the kernel.
    shapes = [(64, 4, 3, None), (64, 4, 3, 168), (64, 4, 2, 168), (128, 8, 3, 168)]
    if side < 32:
        shapes += [(64, 4, 2, None), (32, 4, 3, None)]
    width = max(16, 1 << (side - 1).bit_length())
    for shape_ in shapes:
        cfg.block_m, cfg.num_warps, cfg.num_stages, maxnreg = shape_
        cfg.maxnreg = {(width, 64): maxnreg} if maxnreg else {}
        try:
            out = launch(q, k, v, rph, rpw)
            ms = cuda_time_ms(lambda: launch(q, k, v, rph, rpw), iters)
        except Exception as exc:  # a launch shape that does not fit (registers, shared memory)
            print(f"triton {shape_} failed: {exc}", flush=True)
            continue
        row("triton bm={} w={} s={} reg={}".format(*shape_), ms, out)
    cfg.block_m, cfg.num_warps, cfg.num_stages, cfg.maxnreg = default
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="vit_b", choices=list(SAM_CONFIGS))
    p.add_argument(
        "--variants", nargs="+", default=["bf16-eager", "bf16-compile-flex"], choices=list(VARIANTS)
    )
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--official", action="store_true", help="also time Meta's encoder")
    p.add_argument("--budget-s", type=float, default=480, help="skip variants after this")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--static", action="store_true", help="compile per batch size, not dynamic")
    p.add_argument("--flex-kernel", action="store_true", help="time the attention kernels alone")
    p.add_argument(
        "--profile", nargs="*", default=[], choices=list(VARIANTS), help="profile these variants"
    )
    p.add_argument("--profile-out", type=Path, default=None, help="a folder for the tables")
    p.add_argument(
        "--int8-gemm", choices=["auto", "tiled", "persistent"], default="auto",
        help="the int8/fp8 layers' kernel: models/gemm_persistent.py (auto: on Hopper) or "
        "the tile-per-program models/gemm_kernel.py",
    )  # fmt: skip
    p.add_argument(
        "--persistent-config", type=int, default=None,
        help="every int8 layer in this launch shape (an index into models.gemm_persistent's "
        "SWEEP) in place of `served_config`'s",
    )  # fmt: skip
    args = p.parse_args()
    gemm_persistent.ENABLED = {"auto": None, "tiled": False, "persistent": True}[args.int8_gemm]
    if args.persistent_config is not None:
        gemm_persistent.SERVED = gemm_persistent.SWEEP[args.persistent_config]
    started = time.perf_counter()
    env = environment()
    print(env, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_sam(SAM_CONFIGS[args.model], None, seed=0).to(DEVICE)
    photos = load_photos(args.images)
    if any("calphotos" in name.split("-") for name in [*args.variants, *args.profile]):
        global CALIBRATION
        CALIBRATION, _ = tf.preprocess_images([ph.flip(1) for ph in photos], base.config, DEVICE)
    fid = fidelity_inputs(photos, base)
    with torch.inference_mode():
        ref_embed = torch.cat([base.encode(fid[0][i : i + 1]) for i in range(len(photos))])
        ref_masks = masks_of(base, ref_embed, fid[2], fid[1], photos)
    rows: list[dict[str, Any]] = []
    if args.flex_kernel:
        rows += attention_kernels(8, args.iters)
    for name in args.profile:
        out = args.profile_out / f"profile_{name}.txt" if args.profile_out else None
        with runtime_knobs(name):  # a variant's switches hold for its profile too
            profile_variant(name, base, 8, out)
    if args.official:
        rows += official_baseline([1, 8], args.iters)
        print(rows[-2:], flush=True)
    for name in args.variants:
        if time.perf_counter() - started > args.budget_s:
            print(f"budget spent: skipping {name}", flush=True)
            continue
        try:
            with runtime_knobs(name):
                rows += run_variant(
                    args.static,
                    name,
                    base,
                    photos,
                    fid,
                    ref_embed,
                    ref_masks,
                    args.batch_sizes,
                    args.iters,
                )
        except Exception as exc:  # report and go on: one broken variant must not lose the rest
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()  # where: a GPU call's log is all there is to read
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            torch._dynamo.reset()
            empty_cache()
    write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    print(
        f"\n{env['device']}, torch {env['torch']}, {env['date']}, model {args.model}, "
        f"{len(photos)} photos for fidelity"
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
            "embed_rel_err",
            "tflops",
            "rel_err",
            "mask_iou_mean",
            "mask_iou_min",
            "error",
        ],
    )


if __name__ == "__main__":
    main()
