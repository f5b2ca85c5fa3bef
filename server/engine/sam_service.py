"""SAM's requests on the engine: embed, segment, segment everything, cached embeddings.

The engine (`server.engine.services.Engine`) builds the model, its stages and batchers and
hands them here; this is what a call does with them: the embedding cache (one encoding per
image, shared by every waiter), the low-res handles of a refinement, the size of the masks
a request would hold (refused up front with 413), and the batchers' queues.
"""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.sam.automatic_pipeline import GridMaskGenerator
from server.domain import (
    EmbeddingFile,
    EmbedResult,
    Image,
    ModelInfo,
    PromptMasks,
    SegmentRequest,
    SegmentResult,
)
from server.engine.batcher import Batcher, with_queues
from server.engine.cache import EmbeddingCache, ImageEmbedding, LowResStore
from server.engine.everything import EverythingMasks, EverythingRunner, refuse_over_budget
from server.engine.stages import DecodeItem, EncodeItem, SamStages
from server.errors import ServiceError
from server.settings import Settings

# SAM 2's `.npz` arrays, in `ImageEmbedding.tensors`' order: the names that the community
# SAM 2 ONNX decoders give their inputs (`embedding_file` says what each holds)
SAM2_FILE_ARRAYS = ("image_embed", "high_res_feats_0", "high_res_feats_1")


def _check_everything(
    runner: EverythingRunner, generator: GridMaskGenerator[Any], size: tuple[int, int]
) -> None:
    """A job that cannot run on this image is the client's 422 (or 413 for memory)."""
    try:
        generator.check_size(size)
    except ValueError as exc:
        raise ServiceError(422, "invalid_request", str(exc)) from None
    runner.check_memory(generator, size)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _half(tensor: torch.Tensor) -> np.ndarray:
    """A cached `[C, h, w]` as the host float16 `[1, C, h, w]` that ONNX decoders take."""
    return tensor[None].to(torch.float16).cpu().numpy()


@dataclass
class SamParts:
    stages: SamStages  # or its SAM 2 counterpart, `Sam2Stages`
    info: ModelInfo
    encoder: Batcher[EncodeItem, ImageEmbedding]
    decoder: Batcher[DecodeItem, list[PromptMasks]]
    everything: EverythingRunner  # with the model's own generator (SAM's or SAM 2's)
    sam2: bool = False  # SAM 2.1: its entries hold high-res features beside the embedding


class SamService:
    """What a SAM call does, given the loaded model's parts and the engine's caches."""

    def __init__(
        self,
        parts: SamParts,
        cache: EmbeddingCache,
        low_res: LowResStore,
        settings: Settings,
        worker: ThreadPoolExecutor,
    ) -> None:
        self.parts = parts
        self.cache = cache
        self.low_res = low_res
        self.settings = settings
        self.worker = worker

    async def _embedding(
        self,
        image: Image | None,
        image_id: str | None,
        deadline: float | None,
        timing: dict[str, float] | None = None,
    ) -> tuple[ImageEmbedding, bool]:
        """The image's embedding, cached or encoded; `timing` gets the encoder's `queue`
        wait when this call's own encode ran (not for a hit, nor one shared with another)."""
        sam = self.parts
        if image is None:
            assert image_id is not None
            entry = self.cache.get(image_id)
            if entry is None:
                raise ServiceError(
                    404,
                    "unknown_image_id",
                    f"image_id {image_id} is not cached (never sent, or evicted); "
                    "send the image again",
                )
            return entry, True

        async def compute() -> ImageEmbedding:
            # shared by every request waiting for this image: each keeps its own deadline
            # (get_or_compute), so the queue admits by this first one but never expires it
            # the pixels may be a scaled decode: masks and sizes are the image's own
            item = EncodeItem(
                image.image_id, image.pixels, original_size=(image.height, image.width)
            )
            return await sam.encoder.submit(item, admit_by=deadline, timing=timing)

        return await self.cache.get_or_compute(image.image_id, compute, deadline)

    async def embed(self, image: Image, deadline: float | None = None) -> EmbedResult:
        started = time.perf_counter()
        encode_timing: dict[str, float] = {}
        entry, cached = await self._embedding(image, None, deadline, encode_timing)
        return EmbedResult(
            image_id=entry.image_id,
            width=entry.original_size[1],
            height=entry.original_size[0],
            cached=cached,
            timing_ms=with_queues(
                {"encode": _ms(time.perf_counter() - started)}, {"encode": encode_timing}
            ),
        )

    def lookup(self, image_id: str) -> EmbedResult:
        """A cached embedding's image, as `/v1/embed` with only an id answers it."""
        entry = self.cache.get(image_id)
        if entry is None:
            raise ServiceError(404, "unknown_image_id", f"image_id {image_id} is not cached")
        height, width = entry.original_size
        return EmbedResult(image_id=image_id, width=width, height=height, cached=True)

    async def segment(self, request: SegmentRequest) -> SegmentResult:
        sam = self.parts
        started = time.perf_counter()
        mask_input = None
        if request.mask_input is not None:  # checked before any encoder work is spent
            image_id = request.image.image_id if request.image else request.image_id
            assert image_id is not None
            mask_input = self.low_res.get(request.mask_input, image_id)
        image = request.image
        if image is not None:  # refused before any encoder work is spent
            self._mask_memory(request, (image.height, image.width))
        encode_timing: dict[str, float] = {}
        entry, cached = await self._embedding(
            request.image, request.image_id, request.deadline, encode_timing
        )
        held = self._mask_memory(request, entry.original_size)
        encoded = time.perf_counter()
        decode_timing: dict[str, float] = {}
        item = DecodeItem(
            entry,
            request.prompts,
            request.multimask,
            mask_input,
            request.return_low_res,
            request.output,
        )
        results = await sam.decoder.submit(
            item, cost=len(request.prompts), memory=held, deadline=request.deadline,
            timing=decode_timing,
        )  # fmt: skip
        for result in results:
            if result.low_res is not None:
                logits = result.low_res  # [K, m, m]; the store keeps a copy of each mask's
                result.handles = [
                    self.low_res.put(entry.image_id, logits[k : k + 1])
                    for k in range(logits.shape[0])
                ]
                result.low_res = None
        done = time.perf_counter()
        return SegmentResult(
            image_id=entry.image_id,
            width=entry.original_size[1],
            height=entry.original_size[0],
            cached=cached,
            results=results,
            timing_ms=with_queues(
                {"encode": _ms(encoded - started), "decode": _ms(done - encoded)},
                {"encode": encode_timing, "decode": decode_timing},
            ),
        )

    def _mask_memory(self, request: SegmentRequest, size: tuple[int, int]) -> int:
        """The bytes the request's masks hold in a decoder batch; 413 when over the budget.

        Estimated before the request joins a batch, so one request too large for memory
        is refused alone instead of failing the batch it would have joined.
        """
        sam = self.parts
        prompts = len(request.prompts)
        held, working = sam.stages.mask_memory(prompts, request.multimask, size)
        masks = sam.stages.config.num_multimask_outputs if request.multimask else 1
        refuse_over_budget(
            held + working,
            self.settings.segment_max_bytes,
            "masks_too_large",
            f"{prompts} prompt(s) x {masks} mask(s) at the image's full size ({size[1]}x{size[0]})",
            "send fewer boxes, set multimask_output to false, or send a smaller image",
        )
        return held

    async def embedding_file(self, image_id: str) -> EmbeddingFile:
        """The cached entry as the file a decoder running in the browser loads, so clicks
        need no round trip: the tensors the model's own decoder reads, rounded to float16
        (half the bytes; the served click and one decoded from the file differ in a few
        edge pixels, tests/server/test_sam2_service.py).

        SAM: a `.npy` `[1, C, h, w]` (256 x 64 x 64 at 1024 px), the image encoder's output,
        which SAM's ONNX decoder takes as `image_embeddings`.

        SAM 2: a `.npz` (plain arrays, no pickle) under the input names of the community
        SAM 2 ONNX decoders, each what Meta's `SAM2ImagePredictor` keeps in `_features`:
        `image_embed` `[1, D, h, w]` (256 x 64 x 64), the stride-16 level with the learned
        `no_mem_embed` already added; `high_res_feats_0` `[1, D/8, 4h, 4w]` (32 x 256 x 256)
        and `high_res_feats_1` `[1, D/4, 2h, 2w]` (64 x 128 x 128), the stride-4 and
        stride-8 levels already through the mask decoder's `conv_s0` / `conv_s1`. A decoder
        given the embedding alone could not run: SAM 2's upscaling reads the other two.
        About 8 MiB at 1024 px.
        """
        entry = self.cache.get(image_id)
        if entry is None:
            raise ServiceError(
                404, "unknown_image_id", f"image_id {image_id} is not cached; embed it first"
            )
        sam2 = self.parts.sam2
        loop = asyncio.get_running_loop()

        def to_file() -> bytes:  # the copy back and the packing: off the event loop
            buf = io.BytesIO()
            if sam2:
                arrays = zip(SAM2_FILE_ARRAYS, entry.tensors, strict=True)
                np.savez(buf, allow_pickle=False, **{name: _half(t) for name, t in arrays})
            else:
                np.save(buf, _half(entry.embedding), allow_pickle=False)
            return buf.getvalue()

        data = await loop.run_in_executor(self.worker, to_file)
        suffix = "npz" if sam2 else "npy"
        return EmbeddingFile(data, suffix, entry.original_size, entry.input_size)

    async def everything(
        self,
        image: Image | None,
        image_id: str | None,
        fields: dict[str, float | int],
        output: str = "rle",
        deadline: float | None = None,
    ) -> tuple[ImageEmbedding, EverythingMasks, dict[str, float]]:
        """Every object in the image: the model's automatic mask generation on the worker."""
        runner = self.parts.everything
        generator = runner.generator(fields)
        size = (image.height, image.width) if image is not None else None
        if size is not None:  # refuse before encoding what could not be finished
            _check_everything(runner, generator, size)
        started = time.perf_counter()
        entry, _ = await self._embedding(image, image_id, deadline)
        encoded = time.perf_counter()
        _check_everything(runner, generator, entry.original_size)
        pixels = image.pixels if image is not None else None
        masks = await runner.run(generator, entry, pixels, output, deadline)
        timing = {"encode": _ms(encoded - started), "generate": _ms(time.perf_counter() - encoded)}
        return entry, masks, timing
