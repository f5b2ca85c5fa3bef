"""The model-independent steps of automatic mask generation ("segment everything").

`GridMaskGenerator` is Meta's generator loop (a grid of single-point prompts per crop,
predicted-IoU and stability filters, masks cut by a crop border dropped, box NMS per crop,
NMS across crops preferring smaller crops, optional small-region clean-up) written on
tensors, step by step (see `models.sam.automatic` for the steps and their host syncs).
What differs between SAM and SAM 2 (how a crop is resized and encoded, how a point is
scaled and decoded, how low-res logits return to the crop's pixels) is left to a subclass:
`models.sam.automatic.AutomaticMaskGenerator` (SAM) and
`models.sam2.automatic.Sam2AutomaticMaskGenerator` (SAM 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch
from torch import Tensor

from models.images import Size
from models.sam.automatic_memory import region_bytes
from models.sam.automatic_ops import (
    batched_nms,
    crop_boxes,
    is_box_near_crop_edge,
    masks_to_boxes,
    point_grid,
    remove_small_regions,
    stability_score,
)
from models.sam.automatic_types import (
    AutomaticMasks,
    AutomaticMaskSettings,
    CropEmbedding,
    CropJob,
    MaskCandidates,
)

__all__ = ["GridMaskGenerator"]

E = TypeVar("E")  # what one crop's encode yields (SAM: a Tensor; SAM 2: Sam2Features)


class GridMaskGenerator(ABC, Generic[E]):
    """Segment everything with a promptable model; subclasses supply the model's hooks."""

    settings: AutomaticMaskSettings

    # -- the model's hooks -----------------------------------------------------------------

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model, and so every tensor of the pipeline, lives."""

    @property
    @abstractmethod
    def mask_threshold(self) -> float:
        """Logit above which a pixel belongs to the mask."""

    @abstractmethod
    def estimate_peak_bytes(self, original_size: Size) -> int:
        """An upper bound on the device memory one `generate` allocates (see
        `models.sam.automatic_memory.estimate_peak_bytes`)."""

    @abstractmethod
    def _input_size(self, crop_size: Size) -> Size:
        """The crop's extent in the model's input frame."""

    @abstractmethod
    def _input_points(self, points: Tensor, crop_size: Size) -> Tensor:
        """float64 crop pixels `[n, 2]` -> float32 model-input coordinates (host side)."""

    @abstractmethod
    def _encode(self, crop: Tensor, job: CropJob) -> E:
        """Embed one uint8 `[h, w, 3]` crop (on the device)."""

    @abstractmethod
    def _check_embedding(self, embedding: E) -> E:
        """A full-image embedding computed elsewhere, validated and on the device."""

    @abstractmethod
    def _decode(self, embedding: E, points: Tensor) -> tuple[Tensor, Tensor]:
        """One single-point prompt per row of `points` `[n, 2]` (model-input frame) ->
        candidate low-res logits `[n, k, m, m]` and their predicted IoU `[n, k]`."""

    @abstractmethod
    def _upscale(self, low_res: Tensor, job: CropJob) -> Tensor:
        """Low-res logits `[k, m, m]` -> float32 logits at the crop's size `[k, ch, cw]`."""

    @abstractmethod
    def _upscale_bytes(self, crop_size: Size) -> int:
        """Device bytes of one mask's `_upscale` plus its stability and box temporaries."""

    @property
    def _measures_every_candidate(self) -> bool:
        """Whether `_measure` is cheap enough to run on every candidate, IoU filter
        included in the keep mask: one host sync per chunk instead of two."""
        return False

    # -- the steps -------------------------------------------------------------------------

    def plan(self, original_size: Size) -> list[CropJob]:
        """The crops of one image (Meta's order) with their point grids on the device.

        Points are computed in float64 on the host as Meta computes them (grid x crop size),
        then scaled to the model input frame by the model's hook; one small copy per crop.
        """
        self.check_size(original_size)
        h, w = original_size
        s = self.settings
        jobs = []
        for index, (box, layer) in enumerate(
            crop_boxes(original_size, s.crop_n_layers, s.crop_overlap_ratio)
        ):
            x0, y0, x1, y1 = box
            crop_size = (y1 - y0, x1 - x0)
            n_side = int(s.points_per_side / (s.crop_n_points_downscale_factor**layer))
            grid = point_grid(n_side)  # [n, 2] float64 in [0, 1]
            points = grid * torch.tensor([x1 - x0, y1 - y0], dtype=torch.float64)  # crop pixels
            offset = torch.tensor([x0, y0], dtype=torch.float64)
            jobs.append(
                CropJob(
                    index=index,
                    layer=layer,
                    box=box,
                    original_size=(h, w),
                    input_size=self._input_size(crop_size),
                    input_points=self._to_device(self._input_points(points, crop_size)),
                    point_coords=self._to_device((points + offset).float()),
                    points_per_batch=s.points_per_batch,
                )
            )
        return jobs

    def check_size(self, original_size: tuple[int, int]) -> None:
        """Refuse an image too small for the crop layers: a crop of zero pixels has no grid."""
        h, w = original_size
        if h <= 0 or w <= 0:
            raise ValueError(f"image size must be positive, got {original_size}")
        s = self.settings
        for (x0, y0, x1, y1), layer in crop_boxes(
            original_size, s.crop_n_layers, s.crop_overlap_ratio
        ):
            if x1 <= x0 or y1 <= y0:
                raise ValueError(
                    f"crop_n_layers={s.crop_n_layers} cuts a {w}x{h} image into crops of zero "
                    f"pixels at layer {layer}: use fewer crop layers or a larger image"
                )

    @torch.inference_mode()
    def encode_crop(self, image: Tensor, job: CropJob) -> CropEmbedding[E]:
        """Embed one crop of a uint8 `[H, W, 3]` image (preferably already on the device)."""
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.dtype} {image.shape}")
        if tuple(image.shape[:2]) != job.original_size:
            raise ValueError(f"image is {tuple(image.shape[:2])}, the plan {job.original_size}")
        x0, y0, x1, y1 = job.box
        return CropEmbedding(job.index, self._encode(image[y0:y1, x0:x1], job))

    def embedding_for(self, job: CropJob, embedding: E) -> CropEmbedding[E]:
        """Use an embedding computed elsewhere (the service's cache) for the full-image crop."""
        if not job.is_full_image:
            raise ValueError("only the full-image crop can use a precomputed embedding")
        return CropEmbedding(job.index, self._check_embedding(embedding))

    @torch.inference_mode()
    def decode_chunk(self, emb: CropEmbedding[E], job: CropJob, chunk: int) -> MaskCandidates:
        """Decode chunk `chunk` of a crop's points (one decoder call) and filter its masks.

        Each point gives its k candidate masks (point-major, as Meta flattens them); kept
        are those with predicted IoU above `pred_iou_thresh`, stability at least
        `stability_score_thresh` and a box not cut by the crop's border. Two host syncs.
        """
        if emb.crop != job.index:
            raise ValueError(f"embedding of crop {emb.crop} given for crop {job.index}")
        if not 0 <= chunk < job.num_chunks:
            raise IndexError(f"chunk {chunk} out of range for {job.num_chunks} chunks")
        s = self.settings
        start = chunk * s.points_per_batch
        stop = min(start + s.points_per_batch, job.num_points)
        low_res, iou = self._decode(emb.embedding, job.input_points[start:stop])
        outputs = iou.shape[1]  # k
        iou = iou.float().flatten()  # [k n], point-major
        candidates = low_res.flatten(0, 1)  # [k n, m, m], the same order
        passed = iou > s.pred_iou_thresh if s.pred_iou_thresh > 0.0 else None
        if passed is None or self._measures_every_candidate:
            flat = torch.arange(iou.shape[0], device=iou.device)
        else:
            flat = torch.nonzero(passed).squeeze(1)  # host sync
            candidates = candidates[flat]
        stability, boxes = self._measure(candidates, job)
        x0, y0 = job.box[:2]
        offset = self._to_device(torch.tensor([x0, y0, x0, y0]))
        keep = ~is_box_near_crop_edge(boxes + offset, job.box, job.original_size)
        if s.stability_score_thresh > 0.0:
            keep &= stability >= s.stability_score_thresh
        if passed is not None and self._measures_every_candidate:
            keep &= passed
        kept = torch.nonzero(keep).squeeze(1)  # host sync
        flat = flat[kept]
        return MaskCandidates(
            job=job,
            low_res=candidates[kept],
            scores=iou[flat],
            stability=stability[kept],
            boxes=boxes[kept],
            point_coords=job.point_coords[start + flat // outputs],
        )

    @torch.inference_mode()
    def finish(
        self, per_crop: Sequence[Sequence[MaskCandidates]], original_size: Size
    ) -> AutomaticMasks:
        """NMS per crop, NMS across crops, optional small-region clean-up, full-res masks.

        per_crop: one list of chunk results per job of the plan, in plan order.
        """
        s = self.settings
        chunks = [c for crop in per_crop for c in crop]
        if sum(len(c) for c in chunks) == 0:
            return self._empty(original_size)
        scores = torch.cat([c.scores for c in chunks])  # [N]
        boxes = torch.cat([c.boxes for c in chunks])  # [N, 4] crop frame
        crop = torch.cat(
            [torch.full_like(c.scores, c.job.index, dtype=torch.int64) for c in chunks]
        )
        crop_xyxy = torch.cat([self._crop_box_rows(c) for c in chunks])  # [N, 4]

        # Duplicates within a crop (crops as NMS categories), then Meta's order: crop-major,
        # by decreasing score within a crop.
        keep = batched_nms(boxes.float(), scores, crop, s.box_nms_thresh)
        keep = keep[torch.sort(crop[keep], stable=True).indices]
        boxes = boxes + torch.cat([crop_xyxy[:, :2], crop_xyxy[:, :2]], dim=1)  # original frame
        if len(per_crop) > 1:  # duplicates across crops: prefer masks from smaller crops
            area = (crop_xyxy[:, 2] - crop_xyxy[:, 0]) * (crop_xyxy[:, 3] - crop_xyxy[:, 1])
            keep = keep[batched_nms(boxes[keep].float(), 1 / area[keep], None, s.crop_nms_thresh)]

        if s.min_mask_region_area > 0:
            keep = self._cap(keep, scores)
            masks = self._paint(chunks, keep, original_size)
            masks, changed = self._remove_small_regions(masks)
            new_boxes = masks_to_boxes(masks)
            nms_thresh = max(s.box_nms_thresh, s.crop_nms_thresh)
            survivors = batched_nms(new_boxes.float(), (~changed).float(), None, nms_thresh)
            survivors = survivors[
                torch.sort(scores[keep[survivors]], descending=True, stable=True).indices
            ]
            masks = masks[survivors]
            final_boxes = torch.where(changed[:, None], new_boxes, boxes[keep])[survivors]
            keep = keep[survivors]
        else:
            keep = keep[torch.sort(scores[keep], descending=True, stable=True).indices]
            keep = self._cap(keep, scores)
            masks = self._paint(chunks, keep, original_size)
            final_boxes = boxes[keep]
        return AutomaticMasks(
            masks=masks,
            scores=scores[keep],
            stability=torch.cat([c.stability for c in chunks])[keep],
            boxes=_xyxy_to_xywh(final_boxes),
            areas=masks.flatten(1).sum(dim=1),
            point_coords=torch.cat([c.point_coords for c in chunks])[keep],
            crop_boxes=_xyxy_to_xywh(crop_xyxy[keep]),
        )

    @torch.inference_mode()
    def generate(self, image: Tensor, embedding: E | None = None) -> AutomaticMasks:
        """All steps in order for one uint8 `[H, W, 3]` image; `embedding` (optional) is the
        full image's, from the model's encode, and replaces the first encoder call.
        """
        original_size = (int(image.shape[0]), int(image.shape[1]))
        image = image.to(self.device, non_blocking=True)
        per_crop = []
        for job in self.plan(original_size):
            if embedding is not None and job.is_full_image:
                emb = self.embedding_for(job, embedding)
            else:
                emb = self.encode_crop(image, job)
            per_crop.append([self.decode_chunk(emb, job, c) for c in range(job.num_chunks)])
        return self.finish(per_crop, original_size)

    # -- helpers ---------------------------------------------------------------------------

    def _to_device(self, t: Tensor) -> Tensor:
        return t.to(self.device, non_blocking=True)

    def _slice(self, job: CropJob) -> int:
        """How many masks of this crop one upscaling slice may hold within `max_work_bytes`."""
        return max(1, self.settings.max_work_bytes // self._upscale_bytes(job.crop_size))

    def _measure(self, low_res: Tensor, job: CropJob) -> tuple[Tensor, Tensor]:
        """Stability `[k]` and XYXY crop-frame boxes `[k, 4]` of low-res logits `[k, m, m]`,
        from the crop-resolution logits (as Meta computes both), built slice by slice.
        """
        threshold = self.mask_threshold
        stability, boxes = [], []
        step = self._slice(job)
        for start in range(0, low_res.shape[0], step):
            logits = self._upscale(low_res[start : start + step], job)  # [s, ch, cw]
            stability.append(
                stability_score(logits, threshold, self.settings.stability_score_offset)
            )
            boxes.append(masks_to_boxes(logits > threshold))
            del logits
        if not stability:  # no mask passed the IoU filter
            empty = low_res.new_zeros(0, 4, dtype=torch.int64)
            return low_res.new_zeros(0, dtype=torch.float32), empty
        return torch.cat(stability), torch.cat(boxes)

    def _crop_box_rows(self, candidates: MaskCandidates) -> Tensor:
        """The crop box of each candidate, `[K, 4]` int64 XYXY (one small host->device copy)."""
        row = self._to_device(torch.tensor(candidates.job.box, dtype=torch.int64))
        return row.expand(len(candidates), 4)

    def _cap(self, keep: Tensor, scores: Tensor) -> Tensor:
        """At most `max_masks` of `keep`, the best predicted IoU first (order otherwise kept)."""
        cap = self.settings.max_masks
        if cap is None or keep.shape[0] <= cap:
            return keep
        best = torch.sort(scores[keep], descending=True, stable=True).indices[:cap]
        return keep[torch.sort(best).values]

    def _paint(self, chunks: Sequence[MaskCandidates], keep: Tensor, original_size: Size) -> Tensor:
        """Full-resolution bool masks `[K, H, W]` of the candidates `keep` (global indices).

        Each survivor is upscaled again from its low-res logits (the same computation as in
        `decode_chunk`, so the same mask) and pasted into its crop's place. One host sync,
        to group the survivors by chunk.
        """
        h, w = original_size
        masks = torch.zeros(keep.shape[0], h, w, dtype=torch.bool, device=keep.device)
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c))
        groups: dict[int, tuple[list[int], list[int]]] = {}
        chunk = 0
        for position, index in sorted(enumerate(keep.tolist()), key=lambda pair: pair[1]):
            while index >= starts[chunk + 1]:  # host sync above (tolist)
                chunk += 1
            local, dest = groups.setdefault(chunk, ([], []))
            local.append(index - starts[chunk])
            dest.append(position)
        for chunk, (local, dest) in groups.items():
            self._paint_chunk(masks, chunks[chunk], local, dest)
        return masks

    def _paint_chunk(
        self, masks: Tensor, candidates: MaskCandidates, local: list[int], dest: list[int]
    ) -> None:
        """`candidates.low_res[local]` at full resolution into `masks[dest]`, in their
        crop's place, `max_work_bytes` at a time."""
        x0, y0, x1, y1 = candidates.job.box
        step = self._slice(candidates.job)
        for start in range(0, len(local), step):
            rows = self._to_device(torch.tensor(local[start : start + step]))
            where = self._to_device(torch.tensor(dest[start : start + step]))
            logits = self._upscale(candidates.low_res[rows], candidates.job)
            masks[where, y0:y1, x0:x1] = logits > self.mask_threshold

    def _remove_small_regions(self, masks: Tensor) -> tuple[Tensor, Tensor]:
        """Meta's clean-up, in place and slice by slice: fill small holes, then drop small
        islands. Returns the masks and which of them changed (`[K]` bool).
        """
        K, H, W = masks.shape
        area = self.settings.min_mask_region_area
        changed = torch.zeros(K, dtype=torch.bool, device=masks.device)
        step = max(1, self.settings.max_work_bytes // region_bytes((H, W)))
        for start in range(0, K, step):
            part = masks[start : start + step]
            part, holes = remove_small_regions(part, area, "holes")
            part, islands = remove_small_regions(part, area, "islands")
            masks[start : start + step] = part
            changed[start : start + step] = holes | islands
        return masks, changed

    def _empty(self, original_size: Size) -> AutomaticMasks:
        h, w = original_size
        device = self.device
        return AutomaticMasks(
            masks=torch.zeros(0, h, w, dtype=torch.bool, device=device),
            scores=torch.zeros(0, device=device),
            stability=torch.zeros(0, device=device),
            boxes=torch.zeros(0, 4, dtype=torch.int64, device=device),
            areas=torch.zeros(0, dtype=torch.int64, device=device),
            point_coords=torch.zeros(0, 2, device=device),
            crop_boxes=torch.zeros(0, 4, dtype=torch.int64, device=device),
        )


def _xyxy_to_xywh(boxes: Tensor) -> Tensor:
    """`[N, 4]` (x0, y0, x1, y1) -> (x0, y0, x1 - x0, y1 - y0), as Meta's `box_xyxy_to_xywh`."""
    return torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1)
