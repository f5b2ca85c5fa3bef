"""The opt-in start-up fidelity check (`SERVE_FIDELITY_CHECK`): the variant the service is
about to serve, run through its own warmed stages, against an fp32 eager copy of each
model on the same weights (`models.fidelity`). A deployment that changes precision,
quantization or checkpoint learns before its first request whether the result still
agrees with fp32 on photos like its own; below a floor, start-up fails (server.http.app).

SAM 2 is measured as SAM is, with the same measures under the same floors, against Meta's
predictor run eagerly (`eager_sam2_runner`). Its embedding error is the image embedding's
(`[256, 64, 64]` at 1024 px), not the two high-res maps': that keeps
`SERVE_FIDELITY_MAX_EMBEDDING_ERROR` one quantity for SAM and SAM 2, and the one measured
for SAM 2's variants (docs/SAM2.md: bf16 1.2% on hiera_large, `python -m bench.sam2_quant`).
The maps feed only the decoder's upscaling, so what they get wrong shows in the mask IoU,
which every mask output is held to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from models import fidelity
from models.sam import load_sam
from models.sam2 import load_sam2
from models.swin import load_swin
from server.engine.sam2_stages import Sam2Stages
from server.engine.stages import SamStages, SwinStage
from server.settings import Settings

log = logging.getLogger(__name__)


class FidelityError(RuntimeError):
    """The served variant is past a fidelity floor the user set: it must not serve."""


@dataclass(frozen=True)
class FidelityReport:
    """Each model's measures (name -> measure -> value) and every floor missed."""

    measures: dict[str, dict[str, float]]
    shortfalls: list[str]


def _sam_reference(s: Settings, stages: SamStages, device: torch.device) -> fidelity.SamRunner:
    """The fp32 eager runner of the weights `stages` serve: SAM's, or SAM 2's (Meta's
    predictor semantics) when the stages are SAM 2's."""
    if isinstance(stages, Sam2Stages):
        model = load_sam2(stages.sam2_config, s.sam_checkpoint, seed=s.seed).to(device)
        return fidelity.eager_sam2_runner(model, device)
    reference = load_sam(stages.config, s.sam_checkpoint, seed=s.seed).to(device)
    return fidelity.eager_sam_runner(reference, device)


def measure_served(
    s: Settings,
    device: torch.device,
    sam: tuple[str, SamStages] | None,
    swin: tuple[str, SwinStage] | None,
) -> FidelityReport:
    """Compare each loaded model's stages (named as /v1/models names them) with its fp32
    eager reference, loaded here and freed after; runs on the GPU worker thread."""
    if s.fidelity_images is None:
        raise ValueError("the fidelity check needs SERVE_FIDELITY_IMAGES")
    started = time.perf_counter()
    photos = fidelity.load_photos(s.fidelity_images, s.fidelity_max_photos)
    measures: dict[str, dict[str, float]] = {}
    shortfalls: list[str] = []
    if sam is not None:
        name, stages = sam
        # the reference lives in the runner only: freed when compare_sam returns
        result = fidelity.compare_sam(
            _sam_reference(s, stages, device), stages.fidelity_outputs, photos
        )
        measures[name] = result.measures()
        missed = result.shortfalls(s.fidelity_min_mask_iou, s.fidelity_max_embedding_error)
        shortfalls += [f"{name}: {miss}" for miss in missed]
    if swin is not None:
        name, stage = swin
        swin_reference = load_swin(stage.config, s.swin_checkpoint, seed=s.seed).to(device)
        swin_result = fidelity.compare_swin(
            fidelity.eager_swin_runner(swin_reference, stage.config, device),
            stage.logits,
            fidelity.swin_views(photos, s.fidelity_swin_views),
        )
        del swin_reference
        measures[name] = swin_result.measures()
        shortfalls += [
            f"{name}: {miss}" for miss in swin_result.shortfalls(s.fidelity_min_top1_agreement)
        ]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("fidelity on %d photos in %.1fs: %s", len(photos), time.perf_counter() - started,
             measures)  # fmt: skip
    return FidelityReport(measures, shortfalls)
