"""Synthetic SAM weights: a real checkpoint whose masks are shapes, honestly labelled.

Seeded random weights make every service figure misleading (masks of noise: responses
of 60-200 KB, mask strings 100x the work, negative scores). These weights keep the image
encoder at its seeded random values (frozen) and train the prompt encoder and the mask
decoder to draw what a prompt names in `models.sam.shapes` (a rounded box, discs around
points, background discs cut out), on crops of real photos:

1. encode every crop once (the encoder is frozen, so its embeddings are fixed);
2. train on random prompts against their shapes: BCE + dice on the low-res logits of all
   four mask tokens (token 0 and the multimask tokens at `MULTIMASK_SIZES`), plus the IoU
   head against each mask's actual IoU with the prompt's (size-1) shape, the measure step
   3 reports, so the top-scored multimask output is the exact one; a quarter of the prompts
   carry the previous click's mask as `mask_input`, as the page's refinement sends it;
3. measure held-out crops (held-out photo when there are three or more) and fresh prompts
   through the service's own post-processing, at each crop's size.

The training steps are in `models.sam.synthetic_training`. The result is Meta's checkpoint
format (`save_synthetic`), with a sidecar (`models.provenance`) naming it "synthetic".
Seeded: the same seed on the CPU gives the same weights.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from models.fidelity import mask_iou
from models.provenance import SYNTHETIC, write_sidecar
from models.sam import Sam, SamConfig, load_sam, pack_prompts
from models.sam.shapes import (
    CORNER_FRACTION,
    DISC_FRACTION,
    HOLE_FRACTION,
    KINDS,
    MULTIMASK_SIZES,
    ShapePrompts,
    sample_prompts,
    shape_masks,
)
from models.sam.synthetic_training import TOKEN_SIZES, SynthesisOptions, train
from models.sam.transforms import postprocess_masks, preprocess_images

__all__ = [
    "SynthesisOptions",
    "SynthesisReport",
    "evaluate",
    "sample_crops",
    "save_synthetic",
    "synthesize",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthesisReport:
    """What the sidecar records and the CLI prints: held-out IoU per prompt kind."""

    model: str
    seed: int
    steps: int
    batch_size: int
    crops: int
    device: str
    heldout_iou: dict[str, float]  # single-mask output vs the shape, mean per kind
    heldout_iou_min: dict[str, float]
    multimask_best_iou: dict[str, float]  # the top-scored multimask output vs the shape
    multimask_top_exact: dict[str, float]  # how often that output is the size-1 one
    # mean |predicted - actual IoU with the size-1 shape| over all 4 outputs: the error of
    # the score the service returns with each mask
    iou_head_error: dict[str, float]
    final_loss: float
    seconds: dict[str, float]

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def of_run(
        cls,
        model: str,
        options: SynthesisOptions,
        device: torch.device,
        steps: int,
        final_loss: float,
        measures: dict[str, dict[str, float]],
        times: tuple[float, float, float, float],
    ) -> SynthesisReport:
        """The report of one run (SAM's or SAM 2's): `measures` from `evaluate`, `times`
        when it started, and finished encoding, training and evaluating."""
        started, encoded, trained, done = times
        return cls(
            model=model,
            seed=options.seed,
            steps=steps,
            batch_size=options.batch_size,
            crops=options.crops,
            device=str(device),
            heldout_iou=measures["iou"],
            heldout_iou_min=measures["iou_min"],
            multimask_best_iou=measures["multimask"],
            multimask_top_exact=measures["exact"],
            iou_head_error=measures["error"],
            final_loss=round(final_loss, 5),
            seconds={
                "encode": round(encoded - started, 1),
                "train": round(trained - encoded, 1),
                "evaluate": round(done - trained, 1),
            },
        )


def sample_crops(
    photos: Sequence[Tensor], n: int, max_side: int, generator: torch.Generator
) -> list[Tensor]:
    """`n` crops (uint8 `[h, w, 3]`): 35-100% of each photo's shorter side, aspect ratios
    from 9:16 to 16:9, every other one mirrored, shrunk to at most `max_side`."""
    g = generator
    crops = []
    for k in range(n):
        photo = photos[int(torch.randint(0, len(photos), (1,), generator=g))]
        H, W = int(photo.shape[0]), int(photo.shape[1])
        side = (0.35 + 0.65 * float(torch.rand(1, generator=g))) * min(H, W)
        aspect = math.exp((float(torch.rand(1, generator=g)) * 2 - 1) * math.log(16 / 9))
        h = max(8, min(H, round(side / math.sqrt(aspect))))
        w = max(8, min(W, round(side * math.sqrt(aspect))))
        y = int(torch.randint(0, H - h + 1, (1,), generator=g))
        x = int(torch.randint(0, W - w + 1, (1,), generator=g))
        crop = photo[y : y + h, x : x + w]
        if k % 2:
            crop = crop.flip(1)
        if max(h, w) > max_side:
            f = max_side / max(h, w)
            size = (max(1, round(h * f)), max(1, round(w * f)))
            resized = F.interpolate(
                crop.permute(2, 0, 1)[None].float(), size, mode="bilinear", antialias=True
            )
            crop = resized[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)
        crops.append(crop.contiguous())
    return crops


@torch.no_grad()
def encode_crops(
    model: Sam, crops: Sequence[Tensor], device: torch.device, batch: int
) -> tuple[Tensor, Tensor]:
    """Embeddings `[N, C, h, w]` (bf16 on CUDA, else fp32) and input sizes `[N, 2]`."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embeddings, sizes = [], []
    for start in range(0, len(crops), batch):
        images, input_sizes = preprocess_images(crops[start : start + batch], model.config, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            embeddings.append(model.encode(images).to(dtype))
        sizes.extend(input_sizes)
    return torch.cat(embeddings), torch.tensor(sizes, dtype=torch.int64)


class HeldoutScores:
    """Held-out measures of synthetic weights, prompt by prompt, then per prompt kind; shared
    by SAM's and SAM 2's `evaluate`, which differ only in how masks reach a crop's size."""

    def __init__(self, total: int) -> None:
        self.single, self.best = torch.zeros(total), torch.zeros(total)
        self.exact, self.error = torch.zeros(total), torch.zeros(total)

    def record(self, rows: Tensor, masks: Tensor, want: Tensor, iou_pred: Tensor) -> None:
        """Prompts `rows`: bool masks `[n, 4, H, W]` against the shapes `want` (the size-1
        shape first), and the IoU head's `[n, 4]` predictions."""
        actual = mask_iou(masks.flatten(0, 1), want[:, :1].expand_as(masks).flatten(0, 1))
        actual = actual.view(len(rows), 4).float()
        self.single[rows] = actual[:, 0].cpu()
        top = iou_pred[:, 1:].float().argmax(1)
        self.best[rows] = actual[:, 1:].gather(1, top[:, None])[:, 0].cpu()
        self.exact[rows] = (top == MULTIMASK_SIZES.index(1.0)).float().cpu()
        self.error[rows] = (iou_pred.float() - actual).abs().mean(1).cpu()

    def per_kind(self, kinds: Sequence[int]) -> dict[str, dict[str, float]]:
        kind_of = torch.tensor(kinds)
        names = ("iou", "iou_min", "multimask", "exact", "error")
        out: dict[str, dict[str, float]] = {name: {} for name in names}
        for k, name in enumerate(KINDS):
            sel = kind_of == k
            out["iou"][name] = round(float(self.single[sel].mean()), 4)
            out["iou_min"][name] = round(float(self.single[sel].min()), 4)
            out["multimask"][name] = round(float(self.best[sel].mean()), 4)
            out["exact"][name] = round(float(self.exact[sel].mean()), 4)
            out["error"][name] = round(float(self.error[sel].mean()), 4)
        return out


@torch.no_grad()
def evaluate(
    model: Sam, crops: Sequence[Tensor], per_kind: int, seed: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Held-out measures per kind, at each crop's own size through `postprocess_masks`:
    single-mask IoU (mean, min), the top-scored multimask output's IoU and how often it is
    the size-1 output, and the IoU head's mean absolute error over all four outputs; every
    IoU against the size-1 shape (what the prompt names), as training scores them."""
    config = model.config
    S = config.image_size
    embeddings, input_sizes = encode_crops(model, crops, device, 8)
    total = per_kind * len(KINDS)
    kinds = [k for k in range(len(KINDS)) for _ in range(per_kind)]
    owner = torch.arange(total) % len(crops)
    prompts = sample_prompts(
        total, input_sizes[owner], S, torch.Generator().manual_seed(seed + 2), kinds
    )
    scores = HeldoutScores(total)
    for c, crop in enumerate(crops):
        rows = (owner == c).nonzero().flatten()
        if rows.numel() == 0:
            continue
        sub = ShapePrompts(*(t[rows].to(device) for t in dataclasses.astuple(prompts)))
        batch = pack_prompts(sub.prompt_sets(), None, device)
        emb = embeddings[c : c + 1].expand(len(rows), -1, -1, -1)
        low_res, iou_pred = model.decode(emb, batch)
        H, W = int(crop.shape[0]), int(crop.shape[1])
        newh, neww = (int(v) for v in input_sizes[c])
        logits = postprocess_masks(low_res.float(), (newh, neww), (H, W), config)
        masks = logits > config.mask_threshold  # [n, 4, H, W]
        xs = torch.arange(W, device=device, dtype=torch.float64) * (neww / W)
        ys = torch.arange(H, device=device, dtype=torch.float64) * (newh / H)
        want = shape_masks(sub, xs.float(), ys.float(), S, TOKEN_SIZES)
        scores.record(rows, masks, want, iou_pred)
    return scores.per_kind(kinds)


def synthesize(
    config: SamConfig,
    photos: Sequence[Tensor],
    options: SynthesisOptions,
    device: torch.device,
) -> tuple[Sam, SynthesisReport]:
    """Train synthetic weights for `config` on crops of `photos`; the model (on the CPU,
    fp32, eval) and what held-out prompts measured."""
    if not photos:
        raise ValueError("synthesize needs at least one photo")
    torch.manual_seed(options.seed)
    started = time.perf_counter()
    model = load_sam(config, None, seed=options.seed).to(device)
    train_photos, heldout_photos = (
        (photos[:-1], photos[-1:]) if len(photos) >= 3 else (photos, photos)
    )
    g = torch.Generator().manual_seed(options.seed)
    max_side = round(1.5 * config.image_size)
    crops = sample_crops(train_photos, options.crops, max_side, g)
    heldout = sample_crops(heldout_photos, options.heldout_crops, max_side, g)
    embeddings, input_sizes = encode_crops(model, crops, device, options.encode_batch)
    encoded = time.perf_counter()
    log.info("encoded %d crops in %.1f s", len(crops), encoded - started)
    final_loss, steps = train(model, embeddings, input_sizes, options, device)
    trained = time.perf_counter()
    del embeddings
    measures = evaluate(model, heldout, options.heldout_prompts, options.seed, device)
    done = time.perf_counter()
    report = SynthesisReport.of_run(
        config.name, options, device, steps, final_loss, measures,
        times=(started, encoded, trained, done),
    )  # fmt: skip
    return model.cpu().float().eval(), report


STATEMENT = (
    "Synthetic SAM weights, made by `python -m models.weights synthesize`: the image encoder "
    "keeps its seeded random weights; the prompt encoder and mask decoder were trained to "
    "draw the shape a prompt names (a box: its region with rounded corners; a foreground "
    "point: a disc of radius 1/8 of the image's longest side; a background point cuts its "
    "disc out; with a box, the mask stays inside the box: a foreground point adds nothing "
    "beyond it, a background point's hole has a radius of at most 1/4 of the box's shorter "
    "side). Each mask's score estimates its IoU with that shape. They segment shapes, not "
    "objects. Not Meta's checkpoint."
)


def float_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's tensors as fp32 copies on the CPU, as a checkpoint holds them."""
    return {k: v.detach().cpu().float().contiguous().clone() for k, v in model.state_dict().items()}


def save_atomically(obj: object, path: Path) -> None:
    """`torch.save` beside `path`, then renamed: a reader never meets half a file."""
    partial = path.with_name(path.name + ".part")
    torch.save(obj, partial)
    os.replace(partial, path)


def save_synthetic(model: Sam, report: SynthesisReport, path: Path) -> Path:
    """Write `model` as Meta's checkpoint format (a plain state dict, Meta's exact keys)
    to `path` (atomically), and its provenance sidecar beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(float_state(model), path)
    write_sidecar(
        path,
        {
            "weights": SYNTHETIC,
            "statement": STATEMENT,
            "model": report.model,
            "task": {
                "disc_radius_fraction_of_longest_side": DISC_FRACTION,
                "box_corner_radius_fraction_of_shorter_side": CORNER_FRACTION,
                "box_hole_max_radius_fraction_of_shorter_side": HOLE_FRACTION,
                "box_with_points": (
                    "the mask stays inside the box: foreground points add nothing beyond it, "
                    "background points cut their (capped) discs out of it"
                ),
                "multimask_sizes": list(MULTIMASK_SIZES),
                "scores": (
                    "every output's predicted IoU is trained against its IoU with the size-1 "
                    "shape, so the size-1 output scores highest"
                ),
            },
            "training": report.as_dict(),
            "torch": torch.__version__,
        },
    )
    return path
