"""How far an optimised variant strays from the fp32 eager model on the same weights.

bf16, int8, fp8 and 2:4 sparsity each buy speed with a different amount of accuracy
(docs/BENCHMARKS.md: on random ViT-B weights, mask IoU 0.993 for bf16, 0.941 for fp8, 0.674
for unfine-tuned 2:4), and that amount depends on the weights, so it has to be measured on
the checkpoint a deployment serves. Both users of this module compare a *candidate* (a
function that runs the variant) with a *reference* (the fp32 eager model) on the same real
photos and prompts:

- `python -m models.fidelity` prints the table for any list of variants;
- the service, when asked (`SERVE_FIDELITY_CHECK`), measures the variant it is about to
  serve, through its own compiled stages, and refuses to start below the floors it is given.

SAM and SAM 2: every photo gets five prompts (two boxes, one point, a foreground and
background pair, a box with a point); all four mask outputs of each (single-mask and the
three multimask) are compared at the photo's size. Swin: seeded crops and flips of the
photos, top-1 agreement and logit error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor

from models.sam import Sam, pack_prompts
from models.sam.prompts import PromptSet
from models.sam.transforms import postprocess_masks, preprocess_images, scale_coords
from models.sam2 import Sam2
from models.sam2 import transforms as sam2_tf
from models.swin import SwinConfig, SwinTransformer
from models.swin import transforms as swin_tf

PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")


def load_photos(folder: Path, limit: int | None = None) -> list[Tensor]:
    """The JPEG and PNG photos in `folder` (sorted by name, EXIF orientation applied) as
    uint8 `[H, W, 3]` tensors; at most `limit` of them."""
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in PHOTO_SUFFIXES)
    if not paths:
        raise ValueError(f"no .jpg or .png photos in {folder}")
    photos = []
    for path in paths[:limit]:
        with Image.open(path) as image:
            rgb = ImageOps.exif_transpose(image).convert("RGB")
        photos.append(torch.from_numpy(np.array(rgb)))
    return photos


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """`||actual - expected|| / ||expected||`, in float64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-30))


def mask_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU per mask of two bool stacks `[N, H, W]` (1.0 where both are empty)."""
    inter = (a & b).flatten(1).sum(1).double()
    union = (a | b).flatten(1).sum(1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def _measures(result: SamFidelity | SwinFidelity) -> dict[str, float]:
    """The float fields of a result (its counts left out): what /metrics exports."""
    return {k: v for k, v in asdict(result).items() if isinstance(v, float)}


# -- SAM ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FidelityPrompt:
    """One prompt in the photo's pixel coordinates (the fields of the service's `Prompt`)."""

    points: tuple[tuple[float, float], ...] = ()
    labels: tuple[int, ...] = ()
    box: tuple[float, float, float, float] | None = None


def fidelity_prompts(height: int, width: int) -> list[FidelityPrompt]:
    """The prompts every photo is decoded with: the forms users send, inside the image."""
    h, w = float(height), float(width)
    central = (w * 0.25, h * 0.25, w * 0.75, h * 0.75)
    return [
        FidelityPrompt(box=central),
        FidelityPrompt(box=(w * 0.1, h * 0.1, w * 0.9, h * 0.9)),
        FidelityPrompt(points=((w / 2, h / 2),), labels=(1,)),
        FidelityPrompt(points=((w / 3, h / 2), (2 * w / 3, h / 2)), labels=(1, 0)),
        FidelityPrompt(points=((w / 2, h / 2),), labels=(1,), box=central),
    ]


class SamOutputs(NamedTuple):
    """What one photo and its prompts give: embedding `[C, h, w]` float32, masks `[P, 4, H,
    W]` bool (single-mask output first, then the multimask ones), scores `[P, 4]` float32."""

    embedding: Tensor
    masks: Tensor
    scores: Tensor


SamRunner = Callable[[Tensor, Sequence[FidelityPrompt]], SamOutputs]


def eager_sam_runner(
    model: Sam, device: torch.device, pixels_for: Callable[[Tensor], Tensor] | None = None
) -> SamRunner:
    """`model` run eagerly, one photo at a time, in the dtype it holds (fp32: the reference).

    Prompts are scaled as the service scales them (`scale_coords`); they lie inside the
    photo, so the service's clipping changes nothing. `pixels_for(photo)`: what the encoder
    sees instead of the photo (a scaled decode of its file); prompts and masks stay in the
    photo's frame, as the service keeps them in the image's.
    """
    config = model.config

    @torch.inference_mode()
    def run(photo: Tensor, prompts: Sequence[FidelityPrompt]) -> SamOutputs:
        size = (int(photo.shape[0]), int(photo.shape[1]))
        pixels = photo if pixels_for is None else pixels_for(photo)
        batch, (input_size,) = preprocess_images([pixels], config, device)
        embedding = model.encode(batch)

        def scaled(xy: object) -> np.ndarray:
            return scale_coords(np.asarray(xy, dtype=np.float32).reshape(-1, 2), size, config)

        sets = [
            PromptSet(
                points=scaled(p.points),
                labels=p.labels,
                box=None if p.box is None else scaled(p.box).reshape(4),
            )
            for p in prompts
        ]
        packed = pack_prompts(sets, None, device)
        low_res, iou = model.decode(embedding.expand(len(sets), -1, -1, -1), packed)
        logits = postprocess_masks(low_res.float(), input_size, size, config)
        return SamOutputs(embedding[0].float(), logits > config.mask_threshold, iou.float())

    return run


def eager_sam2_runner(model: Sam2, device: torch.device) -> SamRunner:
    """SAM 2's reference: `model` run as Meta's `SAM2ImagePredictor` runs it, eagerly, one
    photo and one prompt at a time, in the dtype it holds (fp32: the reference).

    What the predictor does, step for step (tests/models/test_sam2_parity.py holds it to
    Meta's): the photo stretched to the square on the host (`preprocess_image`), prompts
    scaled by (S / W, S / H) (`scale_points`, `scale_boxes`; the service's clipping
    changes nothing inside the photo), box corners before the clicks, and each prompt
    decoded twice: without multimask, which takes SAM 2's stability fallback
    (`select_masks`) as the predictor's single mask does and as the service's single-mask
    column does, and with it. Masks: one bilinear resize to the photo's size.
    """
    config = model.config

    def tensor(values: object) -> Tensor:
        return torch.tensor([values], dtype=torch.float32, device=device)

    @torch.inference_mode()
    def run(photo: Tensor, prompts: Sequence[FidelityPrompt]) -> SamOutputs:
        size = (int(photo.shape[0]), int(photo.shape[1]))
        image = sam2_tf.preprocess_image(photo.cpu().numpy(), config).to(device)
        features = model.encode(image)
        masks, scores = [], []
        for p in prompts:
            points = labels = box = None
            if p.points:
                points = sam2_tf.scale_points(tensor(p.points), size, config)  # [1, N, 2]
                labels = torch.tensor([p.labels], device=device)
            if p.box is not None:
                box = sam2_tf.scale_boxes(tensor(p.box), size, config)  # [1, 4]
            single, multi = (
                model.decode(features, points, labels, box, None, multimask)
                for multimask in (False, True)
            )
            low_res = torch.cat([single.low_res_masks, multi.low_res_masks], dim=1)  # [1, 4, m, m]
            masks.append(sam2_tf.postprocess_masks(low_res, size, config)[0])
            scores.append(torch.cat([single.iou, multi.iou], dim=1).float())
        return SamOutputs(features.image_embed[0].float(), torch.cat(masks), torch.cat(scores))

    return run


@dataclass(frozen=True)
class SamFidelity:
    """A SAM variant against the reference over `photos` photos and `masks` masks."""

    photos: int
    masks: int
    embedding_rel_error: float  # over all photos' embeddings together
    mask_iou_mean: float
    mask_iou_min: float
    score_diff_mean: float  # |predicted IoU - the reference's|
    score_diff_max: float

    def measures(self) -> dict[str, float]:
        return _measures(self)

    def shortfalls(self, min_mask_iou: float, max_embedding_error: float) -> list[str]:
        """Each floor this result misses, said plainly (empty: it passes)."""
        out = []
        if not self.mask_iou_mean >= min_mask_iou:
            out.append(f"mean mask IoU {self.mask_iou_mean:.4f} < floor {min_mask_iou}")
        if not self.embedding_rel_error <= max_embedding_error:
            out.append(
                f"embedding error {self.embedding_rel_error:.4f} > ceiling {max_embedding_error}"
            )
        return out


def compare_sam(
    reference: SamRunner, candidate: SamRunner, photos: Sequence[Tensor]
) -> SamFidelity:
    """Run both on every photo with `fidelity_prompts` and compare what they return."""
    diff_sq = ref_sq = 0.0
    ious: list[Tensor] = []
    score_diffs: list[Tensor] = []
    for photo in photos:
        prompts = fidelity_prompts(int(photo.shape[0]), int(photo.shape[1]))
        want = reference(photo, prompts)
        got = candidate(photo, prompts)
        if got.masks.shape != want.masks.shape:
            raise ValueError(f"masks {tuple(got.masks.shape)}, expected {tuple(want.masks.shape)}")
        a, e = got.embedding.double(), want.embedding.to(got.embedding.device).double()
        diff_sq += float((a - e).square().sum())
        ref_sq += float(e.square().sum())
        masks = want.masks.to(got.masks.device)
        ious.append(mask_iou(got.masks.flatten(0, 1), masks.flatten(0, 1)).cpu())
        score_diffs.append((got.scores - want.scores.to(got.scores.device)).abs().flatten().cpu())
    iou, diffs = torch.cat(ious), torch.cat(score_diffs)
    return SamFidelity(
        photos=len(photos),
        masks=int(iou.numel()),
        embedding_rel_error=math.sqrt(diff_sq / max(ref_sq, 1e-300)),
        mask_iou_mean=float(iou.mean()),
        mask_iou_min=float(iou.min()),
        score_diff_mean=float(diffs.mean()),
        score_diff_max=float(diffs.max()),
    )


# -- Swin ---------------------------------------------------------------------------------

SwinRunner = Callable[[Sequence[Tensor]], Tensor]  # uint8 [H, W, 3] images -> logits [n, K]


def swin_views(photos: Sequence[Tensor], n: int, seed: int = 0) -> list[Tensor]:
    """`n` seeded views of the photos: crops of 40-100% of each side, every other flipped.

    More inputs than photos, and with the object off-centre: random weights give small
    logit margins, so agreement over such views is a stricter test than over the photos."""
    g = torch.Generator().manual_seed(seed)
    views = []
    for k in range(n):
        photo = photos[k % len(photos)]
        h, w = int(photo.shape[0]), int(photo.shape[1])
        ch = max(1, int(h * (0.4 + 0.6 * float(torch.rand(1, generator=g)))))
        cw = max(1, int(w * (0.4 + 0.6 * float(torch.rand(1, generator=g)))))
        y = int(torch.randint(0, h - ch + 1, (1,), generator=g))
        x = int(torch.randint(0, w - cw + 1, (1,), generator=g))
        view = photo[y : y + ch, x : x + cw]
        views.append((view.flip(1) if k % 2 else view).contiguous())
    return views


def eager_swin_runner(
    model: SwinTransformer, config: SwinConfig, device: torch.device, batch: int = 64
) -> SwinRunner:
    """`model` run eagerly in batches of `batch`, in the dtype it holds; float32 logits."""
    dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def run(images: Sequence[Tensor]) -> Tensor:
        out = []
        for start in range(0, len(images), batch):
            x = swin_tf.preprocess_images(list(images[start : start + batch]), config, device)
            out.append(model(x.to(dtype)).float())
        return torch.cat(out)

    return run


@dataclass(frozen=True)
class SwinFidelity:
    """A Swin variant against the reference over `views` inputs."""

    views: int
    top1_agreement: float
    logit_rel_error: float
    logit_max_abs_error: float

    def measures(self) -> dict[str, float]:
        return _measures(self)

    def shortfalls(self, min_top1_agreement: float) -> list[str]:
        if self.top1_agreement >= min_top1_agreement:
            return []
        return [f"top-1 agreement {self.top1_agreement:.4f} < floor {min_top1_agreement}"]


def compare_swin(
    reference: SwinRunner, candidate: SwinRunner, views: Sequence[Tensor]
) -> SwinFidelity:
    want = reference(views)
    got = candidate(views).to(want.device)
    return SwinFidelity(
        views=len(views),
        top1_agreement=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
        logit_rel_error=relative_error(got, want),
        logit_max_abs_error=float((got - want).abs().max()),
    )


if __name__ == "__main__":  # `python -m models.fidelity`: the command line is its own module
    from models.fidelity_cli import main

    raise SystemExit(main())
