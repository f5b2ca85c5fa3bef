"""The engine: loaded models, their batchers and the one GPU worker thread.

The lifespan builds it (`Engine.create`), warms it, then serves; routes reach it through
`await engine.segment(...)`, `engine.embed(...)` and `engine.classify(...)`. GPU work runs
only on the worker thread, so the event loop never blocks and CUDA streams stay simple.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.aot import AotStore, PackageKey, device_name, weights_hash
from models.optimize import EAGER_ON_RECOMPILE, OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.provenance import SYNTHETIC, weights_label
from models.quantize import torchao_unsupported
from models.sam import SAM_CONFIGS, load_sam
from models.sam.automatic import AutomaticMaskGenerator
from models.sam.fused_attention import triton_available
from models.swin import IMAGENET_CLASSES, SWIN_CONFIGS, load_swin
from server.domain import (
    ClassifyResult,
    EmbedResult,
    Image,
    ModelInfo,
    Prediction,
    PromptMasks,
    SegmentRequest,
    SegmentResult,
)
from server.engine.batcher import Batcher, BatchObserver, WorkerLoad
from server.engine.cache import CacheObserver, EmbeddingCache, ImageEmbedding, LowResStore
from server.engine.everything import EverythingMasks, EverythingRunner, refuse_over_budget
from server.engine.faults import Faults
from server.engine.fidelity import FidelityReport, measure_served
from server.engine.stages import (
    ClassifyItem,
    DecodeItem,
    EncodeItem,
    SamStages,
    SwinStage,
    TopK,
)
from server.errors import ServiceError
from server.progress import StartupProgress
from server.settings import Settings

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], None]]  # a start-up step: its label and the worker's call


def resolve_device(name: str) -> torch.device:
    """`auto` means CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("SERVE_DEVICE=cuda but no CUDA device is visible")
    return torch.device(name)


def optimize_options(settings: Settings, device: torch.device) -> OptimizeOptions:
    """Resolve the `auto` settings for the device: bf16, compiled, flex, graphed on CUDA."""
    cuda = device.type == "cuda"
    compile_mode = settings.compile_mode
    if compile_mode == "auto":
        compile_mode = "default" if cuda else "none"
    attention = settings.attention
    if attention == "auto":
        # FlexAttention avoids the dense bias but measured 3.5x slower than SDPA with it on
        # an H100 with torch 2.11; our Triton kernel avoids it without that cost
        # (docs/BENCHMARKS.md). Blocks whose grid the kernel cannot run keep SDPA.
        # AOT packages cannot call our kernel (a Python custom op): SDPA there.
        aot = compile_mode == "aot"
        attention = "triton" if cuda and triton_available() and not aot else "sdpa"
    precision = settings.precision
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    backend = settings.quantization_backend
    if backend == "torchao" and settings.quantization != "none":
        why_not = torchao_unsupported(settings.quantization, device)
        if why_not is not None:
            log.warning("SERVE_QUANTIZATION_BACKEND=torchao: %s; core torch's %s layers "
                        "instead", why_not, settings.quantization)  # fmt: skip
            backend = "core"
    return OptimizeOptions(
        precision=precision,
        quantization=settings.quantization,
        quantization_backend=backend,
        sparsity=settings.sparsity,
        attention=attention,
        # the windows gain too (321 vs 306 img/s at batch 8 on an H100, docs/BENCHMARKS.md)
        window_attention="triton" if attention == "triton" else "sdpa",
        compile_mode=compile_mode,
        cuda_graphs=settings.cuda_graphs and cuda and compile_mode != "none",
    )


def use_compile_cache(folder: Path) -> None:
    """Keep inductor's and Triton's caches (FX graphs, kernels, autotuning) in `folder`.

    Both read these variables when they first compile, which happens after this, on the
    worker thread; a restart with the same folder skips code generation and autotuning.
    """
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.autotune_local_cache = True


def compile_cache_hits(since: dict[str, int] | None = None) -> dict[str, int]:
    """Inductor's FX-graph cache hits and misses in this process (since a snapshot).

    The counters are process-wide: an engine reports the difference over its own warm-up.
    """
    counters = torch._dynamo.utils.counters["inductor"]
    now = {"hit": int(counters["fxgraph_cache_hit"]), "miss": int(counters["fxgraph_cache_miss"])}
    base = since or {}
    return {event: count - base.get(event, 0) for event, count in now.items()}


def _check_everything(
    runner: EverythingRunner, generator: AutomaticMaskGenerator, size: tuple[int, int]
) -> None:
    """A job that cannot run on this image is the client's 422 (or 413 for memory)."""
    try:
        generator.check_size(size)
    except ValueError as exc:
        raise ServiceError(422, "invalid_request", str(exc)) from None
    runner.check_memory(generator, size)


def _item_cost(item: object) -> int:
    """A batch item's cost as its batcher counts it: prompts for the decoder, else one."""
    return len(item.prompts) if isinstance(item, DecodeItem) else 1


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass
class _SamParts:
    stages: SamStages
    info: ModelInfo
    encoder: Batcher[EncodeItem, ImageEmbedding]
    decoder: Batcher[DecodeItem, list[PromptMasks]]
    everything: EverythingRunner


@dataclass
class _SwinParts:
    stage: SwinStage
    info: ModelInfo
    batcher: Batcher[ClassifyItem, TopK]


class Engine:
    """Owns the models and batchers; created and closed by the app's lifespan."""

    def __init__(self, settings: Settings, observer: BatchObserver | None = None) -> None:
        self.device = resolve_device(settings.device)
        settings = settings.for_device(self.device.type)  # batch sizes a laptop can hold
        self.settings = settings
        self.options = optimize_options(settings, self.device)
        # RLE runs found on the GPU (one small copy back) rather than by pycocotools on the
        # host (whole masks copied back, then 10-30 ms of one core each, holding the GIL).
        self.rle_on_device = settings.mask_rle == "device" or (
            settings.mask_rle == "auto" and self.device.type == "cuda"
        )
        self.observer = observer or BatchObserver()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-worker")
        self.cache = EmbeddingCache(
            settings.embedding_cache_bytes,
            host_bytes=settings.embedding_cache_host_bytes,
            device=self.device,
            observer=observer if isinstance(observer, CacheObserver) else None,
        )
        self.low_res = LowResStore(settings.low_res_cache_bytes)
        self.sam: _SamParts | None = None
        self.swin: _SwinParts | None = None
        self.warmup_seconds: float | None = None
        self.no_recompile = False  # set by a compiled warm-up; see _stage_fn
        self.compile_cache_events: dict[str, int] = {"hit": 0, "miss": 0}

    # -- life cycle -------------------------------------------------------------------

    async def load(self, progress: StartupProgress | None = None) -> None:
        """Load (and optimise) every enabled model on the worker thread, a step each."""
        if self.settings.compile_cache_dir is not None:
            use_compile_cache(self.settings.compile_cache_dir)
        await self._run_steps(self.load_steps(), progress)

    async def _run_steps(self, steps: list[Step], progress: StartupProgress | None) -> None:
        loop = asyncio.get_running_loop()
        for label, fn in steps:
            if progress is not None:
                progress.begin(label)
            if self.settings.fault_step_delay_s:
                await asyncio.sleep(self.settings.fault_step_delay_s)
            await loop.run_in_executor(self.worker, fn)

    def load_steps(self) -> list[Step]:
        """The loading steps, labelled for the start-up log and /readyz."""
        s = self.settings
        steps: list[Step] = []
        if s.enable_sam:
            weights = s.sam_checkpoint.name if s.sam_checkpoint else "random weights"
            steps.append((f"loading SAM {s.sam_model} ({weights})", self._set_sam))
        if s.enable_swin:
            weights = s.swin_checkpoint.name if s.swin_checkpoint else "random weights"
            steps.append((f"loading Swin {s.swin_model} ({weights})", self._set_swin))
        return steps

    def _set_sam(self) -> None:
        self.sam = self._load_sam()

    def _set_swin(self) -> None:
        self.swin = self._load_swin()

    def warm_steps(self) -> list[Step]:
        """One step per warmed bucket, labelled; run after `load`.

        Compiled code and CUDA graphs are made per shape, so every bucket is warmed. Eager
        code has nothing to make per shape: one small batch per stage checks the path. On
        the CPU that took warm-up from minutes and 12 GB to seconds (docs/BENCHMARKS.md).
        """
        s = self.settings
        mode = self.options.compile_mode
        every = mode != "none" or self.options.cuda_graphs
        aot = "loading (or building) the AOT package of"
        doing = {"none": "checking", "aot": aot}.get(mode, "compiling")
        # in aot mode the decoder is compiled on a GPU and eager on the CPU (SamStages)
        decoder_eager = mode == "none" or (mode == "aot" and self.device.type != "cuda")
        decoder_doing = "checking" if decoder_eager else "compiling"

        def warmed(buckets: list[int], eager: bool = not every) -> list[int]:
            return buckets[:1] if eager else buckets

        steps: list[Step] = []
        if s.enable_sam:
            for b in warmed(s.buckets_up_to(s.max_batch_size)):
                steps.append((f"{doing} the SAM encoder, batch {b}",
                              partial(self._warm, "sam_encoder", b)))  # fmt: skip
            for b in warmed(s.buckets_up_to(s.decoder_max_batch_prompts), decoder_eager):
                steps.append((f"{decoder_doing} the SAM decoder, {b} prompts",
                              partial(self._warm, "sam_decoder", b)))  # fmt: skip
        if s.enable_swin:
            for b in warmed(s.buckets_up_to(s.classify_max_batch_size)):
                steps.append((f"{doing} Swin, batch {b}", partial(self._warm, "swin", b)))
        return steps

    def _warm(self, stage: str, bucket: int) -> None:
        if stage == "swin":
            assert self.swin is not None
            self.swin.stage.warm(bucket)
            return
        assert self.sam is not None
        if stage == "sam_encoder":
            self.sam.stages.warm_encoder(bucket)
        else:
            self.sam.stages.warm_decoder(bucket)

    def _stage_fn(self, stage: str, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The stage's batch function, with injected faults when a test asked for them.

        After a compiled warm-up, each batch runs under the `eager_on_recompile` stance:
        serving must never stall on the compiler, and a shape warm-up did not meet runs
        eagerly (a few ms slower) instead of recompiling on the one GPU worker thread,
        which holds the GIL for seconds and stalls every request. The stance is held only
        around these calls, so nothing else in the process inherits it.
        """
        s = self.settings
        faults = Faults(
            oom_min_batch=s.fault_oom_min_batch,
            oom_stage=s.fault_oom_stage,
            hang_stage=s.fault_hang_stage,
            hang_s=s.fault_hang_s,
            raise_stage=s.fault_raise_stage,
            alloc_min_cost=s.fault_alloc_min_cost,
        )
        run = faults.wrap(stage, fn, _item_cost)

        def run_batch(items: list[Any]) -> Any:
            if not self.no_recompile:
                return run(items)
            with EAGER_ON_RECOMPILE.hold():
                return run(items)

        return run_batch

    def _batcher_args(self) -> dict[str, object]:
        s = self.settings
        return {
            "executor": self.worker,
            "load": WorkerLoad.of(self.worker),  # every stage's batches share the one worker
            "max_delay_s": s.max_queue_delay_ms / 1000.0,
            "max_queue_size": s.max_queue_size,
            "observer": self.observer,
        }

    def _info(self, name: str, checkpoint: Path | None, buckets: list[int]) -> ModelInfo:
        opts = self.options
        weights = weights_label(checkpoint)  # "random", "synthetic" or the file's name
        if weights == SYNTHETIC:
            log.warning(
                "%s has SYNTHETIC weights (%s): masks are shapes, not objects", name, checkpoint
            )
        return ModelInfo(
            name=name,
            weights=weights,
            precision=opts.variant,
            device=str(self.device),
            compile_mode=opts.compile_mode,
            attention=opts.attention,
            cuda_graphs=opts.cuda_graphs,
            batch_buckets=tuple(buckets),
        )

    def _load_sam(self) -> _SamParts:
        s = self.settings
        if s.sam_model not in SAM_CONFIGS:
            raise ValueError(f"unknown SERVE_SAM_MODEL {s.sam_model!r}; one of {list(SAM_CONFIGS)}")
        config = SAM_CONFIGS[s.sam_model]
        opts = self.options
        model = load_sam(config, s.sam_checkpoint, seed=s.seed).to(self.device, opts.dtype)
        prepare_sam_encoder(model.image_encoder, opts, self.device)
        if s.sam_checkpoint is None:
            log.warning(
                "SAM %s has seeded RANDOM weights (seed %d): masks mean nothing",
                s.sam_model,
                s.seed,
            )
        encoder_buckets = s.buckets_up_to(s.max_batch_size)
        decoder_buckets = s.buckets_up_to(s.decoder_max_batch_prompts)
        stages = SamStages(
            model, config, self.device, opts, encoder_buckets, decoder_buckets,
            self.rle_on_device, work_bytes=s.everything_work_bytes,
            aot=self._aot_store(f"sam_{s.sam_model}", model.image_encoder),
        )  # fmt: skip
        info = self._info(f"sam_{s.sam_model}", s.sam_checkpoint, encoder_buckets)
        args = self._batcher_args()
        encoder: Batcher[EncodeItem, ImageEmbedding] = Batcher(
            "sam_encoder",
            self._stage_fn("sam_encoder", stages.encode),
            max_batch_cost=s.max_batch_size,
            **args,  # type: ignore[arg-type]
        )
        decoder: Batcher[DecodeItem, list[PromptMasks]] = Batcher(
            "sam_decoder",
            self._stage_fn("sam_decoder", stages.decode),
            max_batch_cost=s.decoder_max_batch_prompts,
            max_batch_memory=s.segment_max_bytes,
            **args,  # type: ignore[arg-type]
        )
        everything = EverythingRunner(
            model,
            self.worker,
            max_bytes=s.everything_max_bytes,
            max_concurrent=s.everything_max_concurrent,
            max_waiting=s.everything_max_waiting,
            max_masks=s.everything_max_masks,
            max_work_bytes=s.everything_work_bytes,
            rle_on_device=self.rle_on_device,
        )
        return _SamParts(stages, info, encoder, decoder, everything)

    def _load_swin(self) -> _SwinParts:
        s = self.settings
        if s.swin_model not in SWIN_CONFIGS:
            raise ValueError(
                f"unknown SERVE_SWIN_MODEL {s.swin_model!r}; one of {list(SWIN_CONFIGS)}"
            )
        config = SWIN_CONFIGS[s.swin_model]
        opts = self.options
        model = load_swin(config, s.swin_checkpoint, seed=s.seed).to(self.device, opts.dtype)
        prepare_swin(model, opts)
        if s.swin_checkpoint is None:
            log.warning(
                "Swin %s has seeded RANDOM weights (seed %d): labels mean nothing",
                s.swin_model,
                s.seed,
            )
        buckets = s.buckets_up_to(s.classify_max_batch_size)
        aot = self._aot_store(s.swin_model, model)
        stage = SwinStage(model, config, self.device, opts, buckets, aot=aot)
        info = self._info(s.swin_model, s.swin_checkpoint, buckets)
        batcher: Batcher[ClassifyItem, TopK] = Batcher(
            "swin",
            self._stage_fn("swin", stage.classify),
            max_batch_cost=s.classify_max_batch_size,
            **self._batcher_args(),  # type: ignore[arg-type]
        )
        return _SwinParts(stage, info, batcher)

    def _aot_store(self, name: str, module: torch.nn.Module) -> AotStore | None:
        """Where this model's AOT packages live, keyed by its weights and variant here."""
        folder = self.settings.compile_cache_dir
        if self.options.compile_mode != "aot" or folder is None:
            return None
        key = PackageKey(name, weights_hash(module), self.options.variant, device_name(self.device))
        return AotStore(folder / "aot", key)

    async def warmup(self, progress: StartupProgress | None = None) -> float:
        """Run `warm_steps`; returns (and keeps) the seconds it took."""
        started = time.perf_counter()
        before = compile_cache_hits()
        await self._run_steps(self.warm_steps(), progress)
        self.warmup_seconds = time.perf_counter() - started
        self.compile_cache_events = compile_cache_hits(since=before)
        # from now on, served batches run what warm-up compiled or eagerly (_stage_fn)
        self.no_recompile = self.options.compile_mode != "none"
        log.info("warm-up took %.2fs (compile cache %s)", self.warmup_seconds,
                 self.compile_cache_events)  # fmt: skip
        return self.warmup_seconds

    async def check_fidelity(self) -> FidelityReport:
        """Measure the served variant against the fp32 eager model (`models.fidelity`)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, self._check_fidelity_sync)

    def _check_fidelity_sync(self) -> FidelityReport:
        # served as requests are: after a compiled warm-up, nothing recompiles
        with EAGER_ON_RECOMPILE.hold() if self.no_recompile else nullcontext():
            return measure_served(
                self.settings,
                self.device,
                None if self.sam is None else (self.sam.info.name, self.sam.stages),
                None if self.swin is None else (self.swin.info.name, self.swin.stage),
            )

    def start(self) -> None:
        """Start the batchers' collectors on the running loop."""
        for batcher in self.batchers():
            batcher.start()

    def batchers(self) -> list[Batcher]:  # type: ignore[type-arg]
        out: list[Batcher] = []  # type: ignore[type-arg]
        if self.sam is not None:
            out += [self.sam.encoder, self.sam.decoder]
        if self.swin is not None:
            out.append(self.swin.batcher)
        return out

    @property
    def idle(self) -> bool:
        return all(b.idle for b in self.batchers())

    async def close(self) -> None:
        for batcher in self.batchers():
            await batcher.close()
        self.worker.shutdown(wait=True, cancel_futures=True)

    def models(self) -> list[ModelInfo]:
        return [p.info for p in (self.sam, self.swin) if p is not None]

    # -- requests ---------------------------------------------------------------------

    def _require_sam(self) -> _SamParts:
        if self.sam is None:
            raise ServiceError(503, "not_ready", "SAM is not enabled on this server")
        return self.sam

    async def _embedding(
        self, image: Image | None, image_id: str | None, deadline: float | None
    ) -> tuple[ImageEmbedding, bool]:
        sam = self._require_sam()
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
            return await sam.encoder.submit(item, admit_by=deadline)

        return await self.cache.get_or_compute(image.image_id, compute, deadline)

    async def embed(self, image: Image, deadline: float | None = None) -> EmbedResult:
        started = time.perf_counter()
        entry, cached = await self._embedding(image, None, deadline)
        return EmbedResult(
            image_id=entry.image_id,
            width=entry.original_size[1],
            height=entry.original_size[0],
            cached=cached,
            timing_ms={"encode": _ms(time.perf_counter() - started)},
        )

    def lookup(self, image_id: str) -> EmbedResult:
        """A cached embedding's image, as `/v1/embed` with only an id answers it."""
        entry = self.cache.get(image_id)
        if entry is None:
            raise ServiceError(404, "unknown_image_id", f"image_id {image_id} is not cached")
        height, width = entry.original_size
        return EmbedResult(image_id=image_id, width=width, height=height, cached=True)

    async def segment(self, request: SegmentRequest) -> SegmentResult:
        sam = self._require_sam()
        started = time.perf_counter()
        mask_input = None
        if request.mask_input is not None:  # checked before any encoder work is spent
            image_id = request.image.image_id if request.image else request.image_id
            assert image_id is not None
            mask_input = self.low_res.get(request.mask_input, image_id)
        image = request.image
        if image is not None:  # refused before any encoder work is spent
            self._mask_memory(request, (image.height, image.width))
        entry, cached = await self._embedding(request.image, request.image_id, request.deadline)
        held = self._mask_memory(request, entry.original_size)
        encoded = time.perf_counter()
        item = DecodeItem(
            entry,
            request.prompts,
            request.multimask,
            mask_input,
            request.return_low_res,
            request.output,
        )
        results = await sam.decoder.submit(
            item, cost=len(request.prompts), memory=held, deadline=request.deadline
        )
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
            timing_ms={"encode": _ms(encoded - started), "decode": _ms(done - encoded)},
        )

    def _mask_memory(self, request: SegmentRequest, size: tuple[int, int]) -> int:
        """The bytes the request's masks hold in a decoder batch; 413 when over the budget.

        Estimated before the request joins a batch, so one request too large for memory
        is refused alone instead of failing the batch it would have joined.
        """
        sam = self._require_sam()
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

    async def embedding_npy(self, image_id: str) -> tuple[ImageEmbedding, bytes]:
        """The cached embedding as a float16 `.npy` `[1, C, h, w]` (for browser decoders)."""
        entry = self.cache.get(image_id)
        if entry is None:
            raise ServiceError(
                404, "unknown_image_id", f"image_id {image_id} is not cached; embed it first"
            )
        loop = asyncio.get_running_loop()

        def to_npy() -> bytes:
            array = entry.embedding[None].to(torch.float16).cpu().numpy()
            buf = io.BytesIO()
            np.save(buf, array, allow_pickle=False)
            return buf.getvalue()

        return entry, await loop.run_in_executor(self.worker, to_npy)

    async def everything(
        self,
        image: Image | None,
        image_id: str | None,
        fields: dict[str, float | int],
        output: str = "rle",
        deadline: float | None = None,
    ) -> tuple[ImageEmbedding, EverythingMasks, dict[str, float]]:
        """Every object in the image: SAM's automatic mask generation on the worker."""
        sam = self._require_sam()
        generator = sam.everything.generator(fields)
        size = (image.height, image.width) if image is not None else None
        if size is not None:  # refuse before encoding what could not be finished
            _check_everything(sam.everything, generator, size)
        started = time.perf_counter()
        entry, _ = await self._embedding(image, image_id, deadline)
        encoded = time.perf_counter()
        _check_everything(sam.everything, generator, entry.original_size)
        pixels = image.pixels if image is not None else None
        masks = await sam.everything.run(generator, entry, pixels, output, deadline)
        timing = {"encode": _ms(encoded - started), "generate": _ms(time.perf_counter() - encoded)}
        return entry, masks, timing

    async def classify(
        self, image: Image, top_k: int, deadline: float | None = None
    ) -> ClassifyResult:
        if self.swin is None:
            raise ServiceError(503, "not_ready", "Swin is not enabled on this server")
        started = time.perf_counter()
        top = await self.swin.batcher.submit(ClassifyItem(image.pixels, top_k), deadline=deadline)
        names = IMAGENET_CLASSES
        predictions = [
            Prediction(label=names[i] if i < len(names) else str(i), index=i, score=s)
            for s, i in zip(top.scores, top.indices, strict=True)
        ]
        return ClassifyResult(
            predictions, timing_ms={"classify": _ms(time.perf_counter() - started)}
        )
