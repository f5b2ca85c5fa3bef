"""Segment everything inside the service: one image's automatic masks, step by step.

The model's generator (SAM's `AutomaticMaskGenerator`, SAM 2's `Sam2AutomaticMaskGenerator`,
both `GridMaskGenerator`s) comes from a `GeneratorFactory`, with that model's defaults.
Each step of the generator (one crop encode, one decoder chunk, the finish) is
its own job on the one GPU worker thread. Between two steps the worker takes whatever
else is queued, so interactive encoder and decoder batches interleave with a long
segment-everything request instead of waiting for it (interleaving, not priority: a step
is a few milliseconds of GPU work, so an interactive batch waits at most one step).
The full-image crop reuses the embedding cache; only the final masks leave the device.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from models.images import as_pixel_tensor, used_here
from models.sam import Sam
from models.sam.automatic import (
    AutomaticMaskGenerator,
    AutomaticMaskSettings,
    CropJob,
    MaskCandidates,
)
from models.sam.automatic_pipeline import GridMaskGenerator
from models.sam2 import Sam2, Sam2Features
from models.sam2.automatic import (
    PointDecoder,
    Sam2AutomaticMaskGenerator,
    Sam2AutomaticMaskSettings,
)
from server.domain import EverythingMasks
from server.engine.batcher import WorkerLoad
from server.engine.cache import ImageEmbedding
from server.engine.runs import mask_runs
from server.errors import ServiceError

T = TypeVar("T")

GIB = 2**30


def refuse_over_budget(need: int, limit: int, code: str, what: str, advice: str) -> None:
    """413 before any work on what its estimate says would not fit: how much, the limit,
    and what the client can lower (segment everything and segment's full-size masks)."""
    if need > limit:
        raise ServiceError(
            413,
            code,
            f"{what} may need {_readable(need)} of device memory, over the limit of "
            f"{_readable(limit)}; {advice}",
        )


def _readable(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


# the service's own bounds, never a request's field
_BOUNDS = frozenset({"max_masks", "max_work_bytes"})


@dataclass(frozen=True)
class GeneratorFactory:
    """One model's generator: its settings class (the model's defaults, which a request's
    fields override), the generator over them, and the cached full-image embedding in the
    form that generator takes (SAM: the embedding; SAM 2: with its two high-res maps)."""

    model_name: str
    settings: type[AutomaticMaskSettings]
    build: Callable[[Any], GridMaskGenerator[Any]]
    features: Callable[[ImageEmbedding], Any]

    def fields(self) -> frozenset[str]:
        """The request fields this model's generator takes."""
        return frozenset(f.name for f in dataclass_fields(self.settings)) - _BOUNDS


def sam_generators(model: Sam, model_name: str) -> GeneratorFactory:
    return GeneratorFactory(
        model_name,
        AutomaticMaskSettings,
        partial(AutomaticMaskGenerator, model),
        lambda entry: entry.embedding,
    )


def sam2_generators(
    model: Sam2, model_name: str, decode: PointDecoder | None = None
) -> GeneratorFactory:
    """SAM 2's generators; `decode` the grid's decoder call compiled once for them all
    (`Sam2Stages.everything_decode`), or None for the eager one."""

    def features(entry: ImageEmbedding) -> Sam2Features:
        if len(entry.high_res) != 2:
            raise ValueError(f"image {entry.image_id} has no SAM 2 high-res features")
        return Sam2Features(image_embed=entry.embedding, high_res=entry.high_res)

    return GeneratorFactory(
        model_name,
        Sam2AutomaticMaskSettings,
        partial(Sam2AutomaticMaskGenerator, model, decode=decode),
        features,
    )


class EverythingRunner:
    """Runs automatic mask generation jobs on the worker, bounded in memory and number."""

    def __init__(
        self,
        factory: GeneratorFactory,
        worker: Executor,
        *,
        max_bytes: int,
        max_concurrent: int,
        max_waiting: int,
        max_masks: int,
        max_work_bytes: int,
        rle_on_device: bool = False,
        serving: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self.factory = factory
        # entered around each step: the service's no-recompile stance once warm
        self.serving = serving
        self.worker = worker
        self.max_bytes = max_bytes
        self.max_masks = max_masks
        self.max_work_bytes = max_work_bytes
        self.rle_on_device = rle_on_device
        self._slots = asyncio.Semaphore(max_concurrent)
        self._max_waiting = max_waiting
        self._waiting = 0
        self.steps_run = 0

    def generator(self, fields: dict[str, float | int]) -> GridMaskGenerator[Any]:
        """A generator for the request's settings (the fields it set; the model's defaults
        for the rest), with the service's memory bounds."""
        factory = self.factory
        foreign = sorted(set(fields) - factory.fields())
        if foreign:
            raise ServiceError(
                422,
                "invalid_request",
                f"{', '.join(foreign)}: not a setting of {factory.model_name}'s segment "
                f"everything (it takes {', '.join(sorted(factory.fields()))})",
            )
        try:
            settings = factory.settings(
                **fields,  # type: ignore[arg-type]
                max_masks=self.max_masks,
                max_work_bytes=self.max_work_bytes,
            )
        except ValueError as exc:
            raise ServiceError(422, "invalid_request", str(exc)) from None
        return factory.build(settings)

    def check_memory(self, generator: GridMaskGenerator[Any], size: tuple[int, int]) -> None:
        """Refuse before running what could not fit (413), with what to lower."""
        refuse_over_budget(
            generator.estimate_peak_bytes(size),
            self.max_bytes,
            "everything_too_large",
            f"segment everything on a {size[1]}x{size[0]} image with these settings",
            "lower points_per_side, points_per_batch or crop_n_layers, or send a smaller image",
        )

    async def _step(self, fn: Callable[[], T], deadline: float | None) -> T:
        if deadline is not None and time.monotonic() >= deadline:
            raise ServiceError(504, "deadline_exceeded", "the request's deadline passed")
        loop = asyncio.get_running_loop()

        def run() -> T:
            with torch.inference_mode(), self.serving():
                return fn()

        # a step holds the worker as a batch does: the batchers sharing it collect meanwhile
        load = WorkerLoad.of(self.worker)
        load.started()
        try:
            result = await loop.run_in_executor(self.worker, run)
        finally:
            load.finished()
        self.steps_run += 1
        return result

    async def run(
        self,
        generator: GridMaskGenerator[Any],
        entry: ImageEmbedding,
        pixels: np.ndarray | torch.Tensor | None,
        output: str,
        deadline: float | None,
    ) -> EverythingMasks:
        """All steps for one image; `pixels` (uint8 [H, W, 3], host memory) are needed for
        crop layers, at the image's full size: crops are cut in its pixels (so its callers
        decode it whole, never scaled)."""
        size = entry.original_size
        jobs = generator.plan(size)
        if pixels is None and any(not job.is_full_image for job in jobs):
            raise ServiceError(
                422, "invalid_request", "crop_n_layers > 0 needs the image itself, not an image_id"
            )
        if pixels is not None and tuple(pixels.shape[:2]) != size:
            raise ValueError(
                f"segment everything needs the image's full-size pixels {size}, "
                f"got {tuple(pixels.shape[:2])} (a scaled decode)"
            )
        tensor = None if pixels is None else as_pixel_tensor(pixels)
        if self._slots.locked() and self._waiting >= self._max_waiting:
            raise ServiceError(
                429,
                "queue_full",
                f"{self._waiting} segment-everything requests are already waiting; retry shortly",
                headers={"Retry-After": "2"},
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._run(generator, jobs, entry, tensor, output, deadline)
        finally:
            self._slots.release()

    async def _run(
        self,
        generator: GridMaskGenerator[Any],
        jobs: list[CropJob],
        entry: ImageEmbedding,
        pixels: torch.Tensor | None,
        output: str,
        deadline: float | None,
    ) -> EverythingMasks:
        size = entry.original_size
        device = generator.device
        image = None
        if pixels is not None and len(jobs) > 1:
            image = await self._step(
                lambda: used_here(pixels).to(device, non_blocking=True), deadline
            )
        per_crop: list[list[MaskCandidates]] = []
        steps = 0
        for job in jobs:
            if job.is_full_image:
                emb = generator.embedding_for(job, self.factory.features(entry))
            else:
                assert image is not None
                emb = await self._step(partial(generator.encode_crop, image, job), deadline)
                steps += 1
            chunks = []
            for chunk in range(job.num_chunks):
                chunks.append(
                    await self._step(partial(generator.decode_chunk, emb, job, chunk), deadline)
                )
                steps += 1
            per_crop.append(chunks)

        def finish() -> EverythingMasks:
            out = generator.finish(per_crop, size)
            device_rle = self.rle_on_device and output == "rle"
            return EverythingMasks(
                masks=None if device_rle else out.masks.cpu().numpy(),
                runs=mask_runs([out.masks])[0] if device_rle else None,
                scores=out.scores.float().cpu().numpy(),
                stability=out.stability.float().cpu().numpy(),
                point_coords=out.point_coords.float().cpu().numpy(),
                crop_boxes=out.crop_boxes.cpu().numpy(),
                steps=steps + 1,
            )

        return await self._step(finish, deadline)
