"""SAM 2's automatic mask generation ("segment everything"), with SAM 2's generator defaults.

What Meta's `SAM2AutomaticMaskGenerator` produces, on the same device-resident, step-wise
pipeline as SAM's (`models.sam.automatic_pipeline.GridMaskGenerator`: plan, encode_crop or
embedding_for, decode_chunk, finish; the same host syncs and memory bounds). What SAM 2
changes is given here as the pipeline's hooks:
- a crop is stretched to the square input (no letterbox), so a point scales by (S/w, S/h)
  and low-res logits return to the crop's pixels with one bilinear resize;
- the embedding is `Sam2Features` (image embedding plus the two high-res levels);
- the defaults: `pred_iou_thresh` 0.8 (SAM: 0.88), and three settings SAM lacks:
  `mask_threshold`, `multimask_output` (False: one mask per point, through the decoder's
  stability fallback) and `use_m2m` (each candidate decoded once more with its own low-res
  logits as the mask input, single-mask, before the filters).
Meta's `min_mask_region_area` fills holes and removes sprinkles in the low-res logits
with a CUDA extension (silently skipped where it is not built) instead of SAM's clean-up
of the final masks; it is refused here rather than answered with SAM's different rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.images import Size
from models.sam.automatic_memory import estimate_peak_bytes
from models.sam.automatic_pipeline import GridMaskGenerator
from models.sam.automatic_types import (
    AutomaticMasks,
    AutomaticMaskSettings,
    CropJob,
    MaskCandidates,
)
from models.sam.transformer import decoder_attention
from models.sam2.config import Sam2Config
from models.sam2.measure_kernel import measure_upscaled, paint_upscaled
from models.sam2.model import Sam2, Sam2Features
from models.sam2.transforms import scale_points
from models.triton_device import runs_triton

__all__ = [
    "AutomaticMasks",
    "PointDecoder",
    "Sam2AutomaticMaskGenerator",
    "Sam2AutomaticMaskSettings",
    "point_decoder",
    "preprocess_crop",
]

# Meta clamps the low-res logits it hands back as the next round's mask input.
_MASK_INPUT_CLAMP = 32.0
# Extra `[D, h, w]`-sized decoder activations per prompt set over SAM's: the outputs of
# the two high-res skip additions (stride 8: D/4 x 2h x 2w, stride 4: D/8 x 4h x 4w).
_HIGH_RES_ACTIVATIONS = 3


@dataclass(frozen=True)
class Sam2AutomaticMaskSettings(AutomaticMaskSettings):
    """Meta's `SAM2AutomaticMaskGenerator` arguments (same names, defaults and meaning),
    plus SAM's two memory bounds (`max_work_bytes`, `max_masks`)."""

    pred_iou_thresh: float = 0.8
    mask_threshold: float = 0.0
    multimask_output: bool = True
    use_m2m: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not math.isfinite(self.mask_threshold):
            raise ValueError("mask_threshold must be finite")
        if self.min_mask_region_area != 0:
            raise ValueError(
                "min_mask_region_area is not supported for SAM 2 (Meta fills holes in the "
                "low-res logits with a CUDA extension, a different rule from SAM's): use 0"
            )


def preprocess_crop(crop: Tensor, config: Sam2Config) -> Tensor:
    """uint8 `[h, w, 3]` (any device) -> normalised `[1, 3, S, S]` fp32 on that device.

    `models.sam2.transforms.preprocess_image`'s arithmetic (Meta's ToTensor, antialiased
    bilinear Resize to the square, Normalize) on a tensor, so crops never leave the device.
    """
    x = crop.permute(2, 0, 1)[None].float() / 255.0
    size = config.image_size
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    mean = torch.tensor(config.pixel_mean, device=x.device).reshape(1, 3, 1, 1)
    std = torch.tensor(config.pixel_std, device=x.device).reshape(1, 3, 1, 1)
    return (x - mean) / std


# (image_embed [1, D, e, e], s0, s1, points [n, 2] model-input frame, multimask) ->
# (low-res logits [n, k, m, m], predicted IoU [n, k]): one chunk of single-point prompts
PointDecoder = Callable[[Tensor, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor]]


def point_decoder(model: Sam2) -> PointDecoder:
    """The grid's decoder call on tensors only, for `torch.compile` to take whole.

    Eager, the decoder with 64 prompts is dozens of separate passes over 64 copies of the
    image embedding (layer norms, additions, GELU): 10 ms a chunk, 167 ms of a photo's
    segment everything in bf16 on the H100 (`python -m bench.everything_stages`). Compiled,
    inductor fuses those passes; the arithmetic and its order are the same.
    """

    def decode(
        image_embed: Tensor, s0: Tensor, s1: Tensor, points: Tensor, multimask: bool
    ) -> tuple[Tensor, Tensor]:
        labels = torch.ones(points.shape[0], 1, dtype=torch.int64, device=points.device)
        features = Sam2Features(image_embed=image_embed, high_res=(s0, s1))
        pred = model.decode(features, points[:, None], labels, multimask=multimask)
        return pred.low_res_masks, pred.iou

    return decode


def compiled_call(compiled: PointDecoder) -> PointDecoder:
    """`compiled` (a `point_decoder` under `torch.compile(dynamic=None)`) called so that
    warm-up's graph is the one every request takes: the service serves under a
    no-recompile stance, where a missed graph runs eagerly (176 against 96 ms a photo for
    SAM 2.1 large in TF32 on the H100; docs/BENCHMARKS.md, issue 24's eleventh session).

    - Only the chunk's point count is dynamic. With every size dynamic, duck sizing gave
      sizes equal at the first call one symbol: a 64-point warm-up shared its symbol with
      s1's 64 channels, and the graph was specialised to 64 points.
    - The graph is specialised to its inputs' kind of tensor and strides, size-1 dimensions
      included. A request's cached features (a row of the encoder's batch) and its point
      grid (made outside inference mode) differed from warm-up's fresh tensors in both, so
      each input is made an inference tensor with row-major strides (a copy only if not).
    """

    def decode(
        image_embed: Tensor, s0: Tensor, s1: Tensor, points: Tensor, multimask: bool
    ) -> tuple[Tensor, Tensor]:
        image_embed, s0, s1, points = (_canonical(t) for t in (image_embed, s0, s1, points))
        torch._dynamo.maybe_mark_dynamic(points, 0)
        return compiled(image_embed, s0, s1, points, multimask)

    return decode


def _canonical(t: Tensor) -> Tensor:
    """`t` itself if it is an inference tensor with a fresh row-major tensor's strides and
    offset, else such a copy of it (`compiled_call`)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    fresh = t.stride() == tuple(reversed(strides)) and t.storage_offset() == 0
    if fresh and t.is_inference():
        return t
    with torch.inference_mode():
        return t.clone(memory_format=torch.contiguous_format)


class Sam2AutomaticMaskGenerator(GridMaskGenerator[Sam2Features]):
    """Segment everything with a SAM 2 model; see `GridMaskGenerator` for the steps.

    The crop embedding is `Sam2.encode`'s `Sam2Features` of batch 1. `decode` is the grid's
    decoder call (`point_decoder(model)`, eager, by default): the service and the benches
    give one compiled once per model, so every request's generator shares its code.
    """

    settings: Sam2AutomaticMaskSettings

    def __init__(
        self,
        model: Sam2,
        settings: Sam2AutomaticMaskSettings | None = None,
        decode: PointDecoder | None = None,
    ) -> None:
        self.model = model
        self.config: Sam2Config = model.config
        self.settings = settings if settings is not None else Sam2AutomaticMaskSettings()
        self.decode = decode if decode is not None else point_decoder(model)
        # stability, boxes and painting by `models.sam2.measure_kernel` where it runs
        self._fused_measure = runs_triton(self.device)

    @property
    def device(self) -> torch.device:
        return self.model.no_mem_embed.device

    @property
    def mask_threshold(self) -> float:
        return self.settings.mask_threshold

    def estimate_peak_bytes(self, original_size: Size) -> int:
        """SAM's bound for the same geometry (its upscaling through the padded square is
        larger than SAM 2's direct resize), plus the high-res features: resident with each
        embedding and added in the decoder's upscaling; with `use_m2m`, the mask inputs.
        """
        c = self.config
        item = torch.empty((), dtype=self.model.dtype).element_size()
        D, e, m = c.d_model, c.embedding_size, c.mask_input_size
        base = estimate_peak_bytes(
            c.prompt_config(),
            self.settings,
            original_size,
            self.model.dtype,
            decoder_activations_extra=_HIGH_RES_ACTIVATIONS,
        )
        high_res = 2 * 3 * D * e * e * item  # s0 + s1 = 3 [D, e, e] per embedding, two live
        refine = 0
        if self.settings.use_m2m:
            P = self.settings.points_per_batch
            refine = 2 * c.num_multimask_outputs * P * (m * m * item + D * e * e * item)
        return base + high_res + refine

    def _input_size(self, crop_size: Size) -> Size:
        return self.config.image_size, self.config.image_size

    def _input_points(self, points: Tensor, crop_size: Size) -> Tensor:
        # float32 first, then normalise and scale: Meta's `_process_batch` order
        return scale_points(points.float(), crop_size, self.config)

    def _encode(self, crop: Tensor, job: CropJob) -> Sam2Features:
        return self.model.encode(preprocess_crop(crop, self.config))

    def _check_embedding(self, embedding: Sam2Features) -> Sam2Features:
        """Features of the whole image from `Sam2.encode` (batch 1, or one image's rows)."""
        c = self.config
        D, e = c.d_model, c.embedding_size
        expected = [(1, D, e, e), (1, D // 8, 4 * e, 4 * e), (1, D // 4, 2 * e, 2 * e)]
        tensors = [embedding.image_embed, *embedding.high_res]
        tensors = [t[None] if t.ndim == 3 else t for t in tensors]
        for name, t, shape in zip(("image_embed", "s0", "s1"), tensors, expected, strict=True):
            if tuple(t.shape) != shape:
                raise ValueError(f"features' {name} must be {shape}, got {tuple(t.shape)}")
        embed, s0, s1 = (t.to(self.device, non_blocking=True) for t in tensors)
        return Sam2Features(image_embed=embed, high_res=(s0, s1))

    def _decode(self, embedding: Sam2Features, points: Tensor) -> tuple[Tensor, Tensor]:
        """Each point's 3 multimask candidates (or its one single-mask answer), refined once
        with their own logits under `use_m2m`: `[n, k, m, m]`, `[n, k]`."""
        s0, s1 = embedding.high_res
        with decoder_attention(embedding.image_embed.dtype):
            low_res, iou = self.decode(
                embedding.image_embed, s0, s1, points, self.settings.multimask_output
            )
            if self.settings.use_m2m:
                low_res, iou = self._refine(embedding, points, low_res)
        return low_res, iou

    def _refine(
        self, embedding: Sam2Features, points: Tensor, low_res: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Meta's `refine_with_m2m`: every candidate decoded again (single mask) from its
        point and its clamped logits, `points_per_batch` sets per decoder call."""
        n, k, m = low_res.shape[0], low_res.shape[1], low_res.shape[-1]
        points = points.repeat_interleave(k, dim=0)  # [n k, 2], candidate-major as Meta's
        mask_input = low_res.flatten(0, 1)[:, None].clamp(-_MASK_INPUT_CLAMP, _MASK_INPUT_CLAMP)
        labels = torch.ones(points.shape[0], 1, dtype=torch.int64, device=points.device)
        masks, ious = [], []
        step = self.settings.points_per_batch
        for start in range(0, points.shape[0], step):
            sl = slice(start, start + step)
            pred = self.model.decode(
                embedding, points[sl, None], labels[sl], mask_input=mask_input[sl], multimask=False
            )
            masks.append(pred.low_res_masks)
            ious.append(pred.iou)
        return torch.cat(masks).reshape(n, k, m, m), torch.cat(ious).reshape(n, k)

    @property
    def _measures_every_candidate(self) -> bool:
        return self._fused_measure

    def _measure(self, low_res: Tensor, job: CropJob) -> tuple[Tensor, Tensor]:
        """`GridMaskGenerator._measure`'s stability and boxes, from one fused kernel where
        it runs (`models.sam2.measure_kernel`): the crop-size logits never exist."""
        if not self._fused_measure:
            return super()._measure(low_res, job)
        offset = self.settings.stability_score_offset
        return measure_upscaled(low_res, job.crop_size, self.mask_threshold, offset)

    def _paint_chunk(
        self, masks: Tensor, candidates: MaskCandidates, local: list[int], dest: list[int]
    ) -> None:
        if not self._fused_measure:
            super()._paint_chunk(masks, candidates, local, dest)
            return
        rows = self._to_device(torch.tensor(local))
        where = self._to_device(torch.tensor(dest))
        box = candidates.job.box
        paint_upscaled(masks, candidates.low_res, rows, where, box, self.mask_threshold)

    def _upscale(self, low_res: Tensor, job: CropJob) -> Tensor:
        """One bilinear resize to the crop (Meta's `postprocess_masks` with no hole filling)."""
        up = F.interpolate(
            low_res[:, None].float(), job.crop_size, mode="bilinear", align_corners=False
        )
        return up[:, 0]

    def _upscale_bytes(self, crop_size: Size) -> int:
        """The float32 low-res copy and crop-size logits, two stability maps and the mask."""
        m = self.config.mask_input_size
        ch, cw = crop_size
        return 4 * m * m + 4 * ch * cw + 3 * ch * cw
