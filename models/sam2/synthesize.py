"""Synthetic SAM 2.1 weights: a checkpoint in Meta's format whose masks are shapes, honestly
labelled. The counterpart of `models.sam.synthesize`, with the same task, training and
measures; what SAM 2 changes:

- the image encoder (Hiera + FPN) and `no_mem_embed` keep their seeded random weights
  (the neck's lateral convolutions scaled so that the embedding's spread is 1); the
  decoder's high-res projections (`conv_s0`, `conv_s1`, applied once per image at encode
  time) are zero and stay so: shapes need no image detail, and their random values only
  added noise that training had to learn to drown; the prompt encoder and the rest of the
  mask decoder are trained (`models.sam.synthetic_training.train_decoder`);
- every crop is stretched to the square input (SAM 2 keeps no aspect ratio), so the shapes
  are drawn in that square frame: a point's disc is an ellipse on a non-square photo;
- the file is `{"model": state_dict}` with Meta's key names for the image path (no video
  modules: Meta's `build_sam2` loads it with `strict=False`); the sidecar
  (`models.provenance`) names it "synthetic".

Seeded: the same seed on the CPU gives the same weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from models.provenance import SYNTHETIC, write_sidecar
from models.sam import pack_prompts
from models.sam.prompts import PromptBatch
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
from models.sam.synthesize import (
    HeldoutScores,
    SynthesisReport,
    float_state,
    sample_crops,
    save_atomically,
)
from models.sam.synthetic_training import (
    TOKEN_SIZES,
    SynthesisOptions,
    init_decoder,
    train_decoder,
)
from models.sam2.automatic import preprocess_crop
from models.sam2.checkpoint import load_sam2, to_meta_keys
from models.sam2.config import Sam2Config
from models.sam2.model import Sam2, Sam2Features

__all__ = [
    "SynthesisOptions",
    "SynthesisReport",
    "encode_crops",
    "evaluate",
    "save_synthetic",
    "synthesize",
]

log = logging.getLogger(__name__)


@torch.no_grad()
def encode_crops(
    model: Sam2, crops: Sequence[Tensor], device: torch.device, batch: int
) -> Sam2Features:
    """Features of every crop, batch `[N, ...]` (bf16 on CUDA, else fp32)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts: list[Sam2Features] = []
    for start in range(0, len(crops), batch):
        images = torch.cat(
            [preprocess_crop(c.to(device), model.config) for c in crops[start : start + batch]]
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            f = model.encode(images)
        s0, s1 = f.high_res
        parts.append(Sam2Features(f.image_embed.to(dtype), (s0.to(dtype), s1.to(dtype))))
    return Sam2Features(
        torch.cat([p.image_embed for p in parts]),
        (torch.cat([p.high_res[0] for p in parts]), torch.cat([p.high_res[1] for p in parts])),
    )


@torch.no_grad()
def _normalise_neck(model: Sam2, crops: Sequence[Tensor], device: torch.device) -> None:
    """Scale the neck's lateral convolutions so that the image embedding's spread is 1 on
    these crops (about what SAM's neck LayerNorm gives). The FPN is linear in its laterals,
    so every level scales alike. Random Hiera features spread 2-3x wider and drown the
    positional encodings that the shapes depend on: trained with them, point prompts
    collapsed to empty masks on the test config."""
    no_mem = model.no_mem_embed.reshape(1, -1, 1, 1)
    embed = encode_crops(model, crops, device, len(crops)).image_embed.float() - no_mem
    gain = 1.0 / max(float(embed.std()), 1e-6)
    for conv in model.image_encoder.neck.convs:
        for t in conv.parameters():
            t.mul_(gain)
    log.info("neck laterals scaled by %.3f (embedding std %.3f -> 1)", gain, 1 / gain)


def _rows(features: Sam2Features, index: Tensor) -> Sam2Features:
    """The features of crops `index` `[B]`, one row per prompt set."""
    s0, s1 = features.high_res
    return Sam2Features(features.image_embed[index], (s0[index], s1[index]))


@torch.no_grad()
def evaluate(
    model: Sam2, crops: Sequence[Tensor], per_kind: int, seed: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Held-out measures per kind at each crop's own size (one bilinear resize of the
    low-res logits, as the service's SAM 2 post-processing): single-mask IoU (mean, min),
    the top-scored multimask output's IoU and how often it is the size-1 output, and the
    IoU head's mean absolute error over all four outputs; every IoU against the size-1
    shape, as `models.sam.synthesize.evaluate` measures SAM's."""
    S = model.config.image_size
    features = encode_crops(model, crops, device, 8)
    total = per_kind * len(KINDS)
    kinds = [k for k in range(len(KINDS)) for _ in range(per_kind)]
    owner = torch.arange(total) % len(crops)
    square = torch.full((total, 2), S, dtype=torch.int64)
    prompts = sample_prompts(total, square, S, torch.Generator().manual_seed(seed + 2), kinds)
    scores = HeldoutScores(total)
    for c, crop in enumerate(crops):
        rows = (owner == c).nonzero().flatten()
        if rows.numel() == 0:
            continue
        sub = ShapePrompts(*(t[rows].to(device) for t in dataclasses.astuple(prompts)))
        batch = pack_prompts(sub.prompt_sets(), None, device)
        index = torch.full((len(rows),), c, dtype=torch.int64, device=device)
        low_res, iou_pred, _ = model.decode_batch(_rows(features, index), batch)
        H, W = int(crop.shape[0]), int(crop.shape[1])
        logits = F.interpolate(low_res.float(), (H, W), mode="bilinear", align_corners=False)
        masks = logits > model.config.mask_threshold  # [n, 4, H, W]
        xs = torch.arange(W, device=device, dtype=torch.float64) * (S / W)
        ys = torch.arange(H, device=device, dtype=torch.float64) * (S / H)
        want = shape_masks(sub, xs.float(), ys.float(), S, TOKEN_SIZES)
        scores.record(rows, masks, want, iou_pred)
    return scores.per_kind(kinds)


def synthesize(
    config: Sam2Config,
    photos: Sequence[Tensor],
    options: SynthesisOptions,
    device: torch.device,
) -> tuple[Sam2, SynthesisReport]:
    """Train synthetic weights for `config` on crops of `photos`; the model (on the CPU,
    fp32, eval) and what held-out prompts measured."""
    if not photos:
        raise ValueError("synthesize needs at least one photo")
    torch.manual_seed(options.seed)
    started = time.perf_counter()
    model = load_sam2(config, None, seed=options.seed).to(device)
    decoder = model.sam_mask_decoder
    frozen = (decoder.conv_s0, decoder.conv_s1)
    with torch.no_grad():  # shapes need no image detail: no random high-res noise either
        for conv in frozen:
            for t in conv.parameters():
                t.zero_()
    train_photos, heldout_photos = (
        (photos[:-1], photos[-1:]) if len(photos) >= 3 else (photos, photos)
    )
    g = torch.Generator().manual_seed(options.seed)
    max_side = round(1.5 * config.image_size)
    crops = sample_crops(train_photos, options.crops, max_side, g)
    heldout = sample_crops(heldout_photos, options.heldout_crops, max_side, g)
    _normalise_neck(model, crops[: options.encode_batch], device)
    features = encode_crops(model, crops, device, options.encode_batch)
    encoded = time.perf_counter()
    log.info("encoded %d crops in %.1f s", len(crops), encoded - started)

    init_decoder(
        model.sam_prompt_encoder, decoder, options.seed, options.attention_gain, keep=frozen
    )
    kept = {id(p) for module in frozen for p in module.parameters()}
    params = [
        p
        for p in [*model.sam_prompt_encoder.parameters(), *decoder.parameters()]
        if id(p) not in kept
    ]

    def decode(index: Tensor, batch: PromptBatch) -> tuple[Tensor, Tensor]:
        low_res, iou, _ = model.decode_batch(_rows(features, index.to(device)), batch)
        return low_res, iou

    square = torch.full((len(crops), 2), config.image_size, dtype=torch.int64)
    prompt_config = config.prompt_config()
    final_loss, steps = train_decoder(
        params, decode, len(crops), square, prompt_config, options, device
    )
    trained = time.perf_counter()
    measures = evaluate(model, heldout, options.heldout_prompts, options.seed, device)
    done = time.perf_counter()
    report = SynthesisReport.of_run(
        config.name, options, device, steps, final_loss, measures,
        times=(started, encoded, trained, done),
    )  # fmt: skip
    return model.cpu().float().eval(), report


STATEMENT = (
    "Synthetic SAM 2.1 weights, made by `python -m models.weights synthesize`: the image "
    "encoder keeps its seeded random weights (its neck scaled to unit spread; the decoder's "
    "high-res projections are zero); the "
    "prompt encoder and mask decoder were trained to draw the shape a prompt names, in the "
    "model's square input frame (every image is stretched to it, so a disc is an ellipse on "
    "a non-square photo): a box: its region with rounded corners; a foreground point: a disc "
    "of radius 1/8 of the input's side; a background point cuts its disc out; with a box, "
    "the mask stays inside the box. Each mask's score estimates its IoU with that shape. "
    "They segment shapes, not objects. Not Meta's checkpoint."
)


def save_synthetic(model: Sam2, report: SynthesisReport, path: Path) -> Path:
    """Write `model` in Meta's format (`{"model": state_dict}`, Meta's image-path keys) to
    `path` (atomically), and its provenance sidecar beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically({"model": to_meta_keys(float_state(model))}, path)
    write_sidecar(
        path,
        {
            "weights": SYNTHETIC,
            "statement": STATEMENT,
            "model": report.model,
            "task": {
                "frame": "the model's square input (the image stretched to it)",
                "disc_radius_fraction_of_input_side": DISC_FRACTION,
                "box_corner_radius_fraction_of_shorter_side": CORNER_FRACTION,
                "box_hole_max_radius_fraction_of_shorter_side": HOLE_FRACTION,
                "multimask_sizes": list(MULTIMASK_SIZES),
                "scores": "every output's predicted IoU against its IoU with the size-1 shape",
            },
            "format": "Meta's {'model': state_dict}, image path only (no video modules)",
            "training": report.as_dict(),
            "torch": torch.__version__,
        },
    )
    return path
