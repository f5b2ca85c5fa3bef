"""SAM 2.1: ours against Meta's `sam2` package in one run, on the same weights.

The weights are ours (`load_sam2`: seeded random, or `--checkpoint`) written in Meta's
release format (`{"model": state_dict}`, Meta's key names, the video modules at Meta's own
initialisation), then loaded by both sides through their official loaders. Per size:

- encoder images/s at batch 1 and 8, bf16: ours `model.to(bfloat16)` + `torch.compile` of
  `Sam2.encode`; Meta's image path (`forward_image`, `_prepare_backbone_features`,
  `no_mem_embed`: what `SAM2ImagePredictor.set_image_batch` runs after its host-side
  transforms) on fp32 weights under `torch.autocast(bfloat16)`, as Meta's README runs it;
  both on the same normalised input tensor; `embed_rel_err`: our bf16 image embedding
  against Meta's fp32 one;
- a click's latency (the image set, then one point -> 3 masks at the photo's size on the
  host, median of `--clicks`): ours decode + upscale + copy, Meta's
  `SAM2ImagePredictor.predict` under autocast;
- segment everything, seconds per photo until the masks are on the host as COCO runs (what
  the service returns): ours fp32 and bf16, eager and with the grid's decoder call
  compiled, against `SAM2AutomaticMaskGenerator` fp32 and under autocast (its
  `uncompressed_rle` output), with the mIoU of each
  against Meta's fp32 masks (each of Meta's masks matched to the best of the other run's,
  averaged; an unmatched one counts 0).

Random weights give no mask at Meta's default thresholds: lower `--pred-iou-thresh`,
`--stability-thresh` (and raise `--mask-threshold`) to time the whole pipeline; real or
synthetic weights (`--checkpoint`, `python -m models.weights synthesize sam2.1_hiera_large`)
give meaningful mIoU.

    python -m bench.sam2 --out sam2.json                                  # GPU, every size
    python -m bench.sam2 --device cpu --sizes sam2_test_tiny --no-compile  # CPU smoke

Meta's package on the GPU machine (no network there; its real torchvision is used): pure
Python wheels built here (sam2 without its CUDA extension, which only its hole filling
needs; antlr4 and iopath publish no wheels), carried in the git-ignored `.whl/sam2`:

    SAM2_BUILD_CUDA=0 pip wheel --no-deps --no-build-isolation -w .whl/sam2 sam2==1.1.0 \
        hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 iopath==0.1.10 \
        portalocker==4.4.2 tqdm==4.70.1
    # there:
    python3 -m pip install -q --no-index --no-deps --target /tmp/sam2site .whl/sam2/*.whl
    PYTHONPATH=/tmp/sam2site python3 -m bench.sam2 --out "$OUT/sam2.json"
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    DEFAULT_IMAGES,
    add_decoder_path_flags,
    cuda_time_ms,
    decoder_paths,
    empty_cache,
    environment,
    load_photos,
    print_table,
    tf32_matmuls,
    write_json,
)
from bench.sam2_meta import (
    RELEASED,
    build_meta,
    meta_encode,
    meta_predictor,
    official_checkpoint,
)
from models.optimize import compile_fn
from models.sam2 import SAM2_CONFIGS, Sam2, Sam2Config, load_sam2
from models.sam2.automatic import (
    Sam2AutomaticMaskGenerator,
    Sam2AutomaticMaskSettings,
    compiled_call,
    point_decoder,
)
from models.sam2.transforms import postprocess_masks, preprocess_image, scale_points
from server.engine.runs import mask_runs

log = logging.getLogger("bench.sam2")

# -- helpers -------------------------------------------------------------------------------


@contextmanager
def autocast(device: str, enabled: bool) -> Iterator[None]:
    with torch.inference_mode(), torch.autocast(device, torch.bfloat16, enabled=enabled):
        yield


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], object], iters: int, device: str, warmup: int = 2) -> float:
    """Median host-clock milliseconds of `fn` (which ends on the host or is synced)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def mean_best_iou(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Each reference mask's best IoU among `other`'s (bool `[M, H, W]`, `[N, H, W]`), averaged."""
    if reference.shape[0] == 0:
        return float("nan")
    if other.shape[0] == 0:
        return 0.0
    a, b = reference.flatten(1).float(), other.flatten(1).float()
    inter = a @ b.T  # [M, N], exact in fp32 below 2^24 pixels
    union = a.sum(1)[:, None] + b.sum(1)[None] - inter
    return float((inter / union.clamp(min=1)).max(dim=1).values.mean())


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.float()
    return float((ours.float() - theirs).norm() / theirs.norm().clamp_min(1e-12))


# -- the three measurements ----------------------------------------------------------------


def bench_encoder(
    config: Sam2Config, ours: Sam2, meta: Any, batches: Sequence[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    device = args.device
    encode = torch.compile(ours.encode, mode=args.compile_mode) if args.compile else ours.encode
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        size = config.image_size
        x = torch.randn(batch, 3, size, size, generator=gen).to(device)
        xb = x.to(torch.bfloat16)
        with torch.inference_mode():
            ours_ms = cuda_time_ms(lambda xb=xb: encode(xb), args.iters)
        with autocast(device, True):
            meta_ms = cuda_time_ms(lambda x=x: meta_encode(meta, x), args.iters)
        with torch.inference_mode():
            embed = encode(xb[:1]).image_embed
            theirs = meta_encode(meta, x[:1])[-1]  # fp32: [h w, 1, D]
            e = config.embedding_size
            theirs = theirs.permute(1, 2, 0).reshape(1, -1, e, e)
        rows.append(
            {
                "model": config.name,
                "batch": batch,
                "ours_img_s": 1000 * batch / ours_ms,
                "meta_img_s": 1000 * batch / meta_ms,
                "speedup": meta_ms / ours_ms,
                "embed_rel_err": rel_err(embed, theirs),
            }
        )
        log.info("encoder %s", rows[-1])
    return rows


def bench_click(
    config: Sam2Config, ours: Sam2, meta: Any, photo: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    device = args.device
    h, w = photo.shape[:2]
    array = photo.numpy()
    point = np.array([[w / 2, h / 2]], dtype=np.float32)
    encode = torch.compile(ours.encode, mode=args.compile_mode) if args.compile else ours.encode

    def our_set_image() -> Any:
        with torch.inference_mode():
            return encode(preprocess_image(array, config).to(device, torch.bfloat16))

    features = our_set_image()
    labels = torch.ones(1, 1, dtype=torch.int64, device=device)

    def our_click() -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            points = scale_points(torch.from_numpy(point).to(device)[None], (h, w), config)
            pred = ours.decode(features, points, labels, multimask=True)
            masks, _ = postprocess_masks(pred.low_res_masks, (h, w), config)
            return masks[0].cpu().numpy(), pred.iou[0].float().cpu().numpy()

    predictor = meta_predictor(meta, config)

    def meta_set_image() -> None:
        with autocast(device, True):
            predictor.set_image(array)

    def meta_click() -> Any:
        with autocast(device, True):
            return predictor.predict(point_coords=point, point_labels=np.array([1]))

    row: dict[str, Any] = {"model": config.name, "photo": f"{w}x{h}"}
    row["ours_set_image_ms"] = wall_ms(our_set_image, args.iters, device)
    row["meta_set_image_ms"] = wall_ms(meta_set_image, args.iters, device)
    meta_set_image()
    row["ours_click_ms"] = wall_ms(our_click, args.clicks, device)
    row["meta_click_ms"] = wall_ms(meta_click, args.clicks, device)
    mine, theirs = torch.from_numpy(our_click()[0]), torch.from_numpy(meta_click()[0])
    row["click_miou"] = mean_best_iou(theirs.bool(), mine.bool())
    log.info("click %s", row)
    return row


def runs_to_masks(counts: Sequence[Any], size: tuple[int, int]) -> torch.Tensor:
    """COCO runs (column-major, the first a run of zeros; ours or Meta's uncompressed RLE)
    of one size -> bool `[K, H, W]`, to compare masks outside the timing."""
    h, w = size
    out = np.zeros((len(counts), h * w), dtype=bool)
    for k, runs in enumerate(counts):
        values = np.arange(len(runs)) % 2 == 1
        out[k] = np.repeat(values, np.asarray(runs, dtype=np.int64))
    return torch.from_numpy(out.reshape(-1, w, h).transpose(0, 2, 1).copy())


def bench_everything(
    config: Sam2Config,
    pipelines: dict[str, Callable[[], tuple[Sam2, Any]]],
    meta: Any,
    photos: Sequence[torch.Tensor],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Seconds per photo until the masks are on the host as COCO runs, what the service
    returns: ours through the service's device-side `mask_runs`, Meta's generator with
    `output_mode="uncompressed_rle"` (its binary masks are decoded from those runs). Each
    entry of `pipelines` builds its (model, decoder call) when its turn comes, so a
    compiled variant cannot change the rows before it."""
    from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator

    device = args.device
    fields = {
        "points_per_side": args.points_per_side,
        "points_per_batch": args.points_per_batch,
        "pred_iou_thresh": args.pred_iou_thresh,
        "stability_score_thresh": args.stability_thresh,
        "mask_threshold": args.mask_threshold,
    }
    meta_generator = SAM2AutomaticMaskGenerator(meta, output_mode="uncompressed_rle", **fields)
    meta_generator.predictor._bb_feat_sizes = meta_predictor(meta, config)._bb_feat_sizes

    def run_meta(photo: torch.Tensor, bf16: bool) -> tuple[list[Any], tuple[int, int]]:
        with autocast(device, bf16):
            records = meta_generator.generate(photo.numpy())
        return [r["segmentation"]["counts"] for r in records], tuple(photo.shape[:2])

    def ours(model: Sam2, decode: Any) -> Callable[[torch.Tensor], Any]:
        settings = Sam2AutomaticMaskSettings(**fields)

        def run(photo: torch.Tensor) -> tuple[list[Any], tuple[int, int]]:
            generator = Sam2AutomaticMaskGenerator(model, settings, decode)
            with torch.inference_mode():
                (runs,) = mask_runs([generator.generate(photo.to(device)).masks])
            return runs.counts, runs.size

        return run

    runs: dict[str, Callable[[], Callable[[torch.Tensor], Any]]] = {
        "meta fp32": lambda: lambda p: run_meta(p, False),
    }
    if args.meta_autocast:
        runs["meta autocast bf16"] = lambda: lambda p: run_meta(p, True)
    for name, build in pipelines.items():
        runs[f"ours {name}"] = lambda build=build: ours(*build())
    reference: list[torch.Tensor] = []
    rows = []
    for name, make in runs.items():
        with tf32_matmuls(name.startswith("ours tf32")):
            try:
                row = _everything_row(config, name, make, photos, reference, device)
            except Exception:  # one variant failing (fp16 overflow, a compile error) is a row
                log.exception("everything %s failed", name)
                if name == "meta fp32":
                    raise
                continue
        rows.append(row)
        log.info("everything %s", row)
        empty_cache()
    return rows


def _everything_row(
    config: Sam2Config,
    name: str,
    make: Callable[[], Callable[[torch.Tensor], Any]],
    photos: Sequence[torch.Tensor],
    reference: list[torch.Tensor],
    device: str,
) -> dict[str, Any]:
    """One pipeline's seconds per photo, masks and mIoU; "meta fp32" fills `reference`."""
    run = make()
    run(photos[0])  # warm-up (compilation, cuDNN plans)
    times, counts, ious = [], [], []
    for i, photo in enumerate(photos):
        sync(device)
        started = time.perf_counter()
        found = run(photo)
        times.append(time.perf_counter() - started)
        masks = runs_to_masks(*found)
        counts.append(masks.shape[0])
        if name == "meta fp32":
            reference.append(masks)
        ious.append(mean_best_iou(reference[i].to(device), masks.to(device)))
    valid = [v for v in ious if v == v]  # NaN: Meta found no mask on that photo
    return {
        "model": config.name,
        "pipeline": name,
        "s_per_image": statistics.median(times),
        "mean_masks": float(np.mean(counts)),
        "miou_vs_meta_fp32": statistics.mean(valid) if valid else float("nan"),
    }


# -- main ----------------------------------------------------------------------------------


PARTS = ("encoder", "click", "everything")
PIPELINES = (
    *("fp32", "bf16", "fp32 compiled", "bf16 compiled", "tf32 compiled", "fp16 compiled"),
    "tf32 encoder fp16 decoder compiled",
    "tf32 bf16 transformer compiled",
)


class Bf16Transformer(torch.nn.Module):
    """A mask decoder's two-way transformer in bf16 inside a TF32 decoder: its inputs cast
    down and its outputs up, so the upscaling and the hypernetwork product, which make the
    logits near the threshold, stay in TF32. Why: bf16 throughout took 82.6 ms a photo at
    mIoU 0.86 and TF32 118.6 at 0.994 (docs/BENCHMARKS.md, issue 24); which part loses the
    fidelity is what this pipeline measures."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.inner = transformer.to(torch.bfloat16)

    def forward(
        self, image: torch.Tensor, image_pe: torch.Tensor, tokens: torch.Tensor,
        valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        low = torch.bfloat16
        hs, keys = self.inner(image.to(low), image_pe.to(low), tokens.to(low), valid)
        return hs.float(), keys.float()


def everything_pipelines(
    config: Sam2Config, path: Path, fp32: Sam2, bf16: Sam2, args: argparse.Namespace
) -> dict[str, Callable[[], tuple[Sam2, Any]]]:
    """Ours, by name (`PIPELINES`): eager fp32, bf16 with the compiled encoder (the
    service's), and with `--compile` the grid's decoder call compiled too (`point_decoder`)
    in fp32, bf16, fp32 with TF32 matmuls (its own copy of the weights, so its compiled code
    is its own), fp16, the encoder in fp32 with TF32 beside an fp16 copy of the decoder
    (the features cast on the way), and TF32 with the decoder's transformer alone in bf16
    (`Bf16Transformer`). Each is built when its turn comes."""

    @functools.cache  # once per model: its rows share the compiled encoder
    def compiled_encoder(model: Sam2) -> Sam2:
        if args.compile:
            model.encode = torch.compile(model.encode, mode=args.compile_mode)  # type: ignore[method-assign]
        return model

    def compiled(model: Sam2) -> tuple[Sam2, Any]:
        inner = compile_fn(point_decoder(model), args.compile_mode, dynamic=None)
        decode = compiled_call(inner)
        return compiled_encoder(model), decode

    def copy(dtype: torch.dtype) -> Sam2:
        model = load_sam2(config, path).to(args.device, dtype)
        model.use_decoder_paths(**decoder_paths(args))
        return model

    def mixed(decoder_dtype: torch.dtype) -> tuple[Sam2, Any]:
        inner = compiled_call(
            compile_fn(point_decoder(copy(decoder_dtype)), args.compile_mode, dynamic=None)
        )

        def decode(
            embed: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, points: torch.Tensor, mm: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cast = (t.to(decoder_dtype) for t in (embed, s0, s1))
            return inner(*cast, points, mm)

        return compiled_encoder(copy(torch.float32)), decode

    def bf16_transformer() -> Sam2:
        model = copy(torch.float32)
        decoder = model.sam_mask_decoder
        decoder.transformer = Bf16Transformer(decoder.transformer)  # type: ignore[assignment]
        return model

    pipelines: dict[str, Callable[[], tuple[Sam2, Any]]] = {
        "fp32": lambda: (fp32, None),
        "bf16": lambda: (compiled_encoder(bf16), None),
    }
    if args.compile:
        pipelines["fp32 compiled"] = lambda: compiled(fp32)
        pipelines["bf16 compiled"] = lambda: compiled(bf16)
        pipelines["tf32 compiled"] = lambda: compiled(copy(torch.float32))
        pipelines["fp16 compiled"] = lambda: compiled(copy(torch.float16))
        pipelines["tf32 encoder fp16 decoder compiled"] = lambda: mixed(torch.float16)
        pipelines["tf32 bf16 transformer compiled"] = lambda: compiled(bf16_transformer())
    return {name: pipelines[name] for name in args.everything_pipelines if name in pipelines}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", nargs="+", default=list(RELEASED), choices=list(SAM2_CONFIGS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--iters", type=int, default=20, help="timed encoder runs per point")
    p.add_argument("--clicks", type=int, default=50)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--everything-photos", type=int, default=4)
    p.add_argument("--everything-sizes", nargs="*", default=None, help="default: --sizes")
    p.add_argument("--checkpoint", type=Path, default=None, help="one size's weights (Meta's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--compile-mode", default="default", help="or max-autotune (minutes more)")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    p.add_argument(
        "--everything-pipelines",
        nargs="+",
        default=["fp32", "bf16", "fp32 compiled", "bf16 compiled"],
        choices=PIPELINES,
        help="ours (the compiled ones need --compile); Meta's fp32 always runs as reference",
    )
    p.add_argument("--no-meta-autocast", dest="meta_autocast", action="store_false")
    add_decoder_path_flags(p)  # ours
    p.add_argument("--points-per-side", type=int, default=32)
    p.add_argument("--points-per-batch", type=int, default=64, help="both sides' decoder calls")
    # Meta's SAM 2 defaults; random weights need lower ones (see the module docstring)
    p.add_argument("--pred-iou-thresh", type=float, default=0.8)
    p.add_argument("--stability-thresh", type=float, default=0.95)
    p.add_argument("--mask-threshold", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.checkpoint is not None and len(args.sizes) != 1:
        p.error("--checkpoint is one size's file: give exactly one --sizes")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)  # ours only: Meta's package logs every set_image at INFO
    env = environment()
    log.info("%s", env)
    photos = load_photos(args.images)[: args.everything_photos]
    everything_sizes = args.sizes if args.everything_sizes is None else args.everything_sizes
    encoder_rows, click_rows, everything_rows = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.sizes:
            config = SAM2_CONFIGS[name]
            # fresh compile caches per size: each model and batch recompiles `encode`, and
            # past dynamo's recompile limit it would silently run eager
            torch._dynamo.reset()
            path = official_checkpoint(config, args.seed, Path(folder), args.checkpoint)
            meta = build_meta(config, path, args.device)
            fp32 = load_sam2(config, path).to(args.device)
            bf16 = load_sam2(config, path).to(args.device, torch.bfloat16)
            for model in (fp32, bf16):
                model.use_decoder_paths(**decoder_paths(args))
            if "encoder" in args.parts:
                encoder_rows += bench_encoder(config, bf16, meta, args.batches, args)
                log.info("encoder: %s", encoder_rows[-len(args.batches) :])  # kept if cut short
            if "click" in args.parts:
                click_rows.append(bench_click(config, bf16, meta, photos[0], args))
                log.info("click: %s", click_rows[-1])
            if "everything" in args.parts and name in everything_sizes:
                pipelines = everything_pipelines(config, path, fp32, bf16, args)
                everything_rows += bench_everything(config, pipelines, meta, photos, args)
            del meta, fp32, bf16
            empty_cache()
    payload = {
        "env": env,
        "args": vars(args),
        "encoder": encoder_rows,
        "click": click_rows,
        "everything": everything_rows,
    }
    write_json(args.out, payload)
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, bf16, compile={args.compile}")
    print("\nEncoder (images/s)\n")
    print_table(
        encoder_rows, ["model", "batch", "ours_img_s", "meta_img_s", "speedup", "embed_rel_err"]
    )
    print("\nA click (ms; the image set, one point -> 3 masks on the host)\n")
    print_table(
        click_rows,
        [
            *("model", "photo", "ours_set_image_ms", "meta_set_image_ms"),
            *("ours_click_ms", "meta_click_ms", "click_miou"),
        ],
    )
    print(f"\nSegment everything ({len(photos)} photos, {args.points_per_side}^2 points)\n")
    print_table(
        everything_rows, ["model", "pipeline", "s_per_image", "mean_masks", "miou_vs_meta_fp32"]
    )
    return payload


if __name__ == "__main__":
    main()
