"""The engine: builds the models, their stages and batchers, and their GPU worker threads.

The engine process (`server.engine.process`) creates it, loads and warms it step by step,
then hands each call to a model's service (`SamService`, `SwinService`), which is what a
request does with the parts built here. GPU work runs only on worker threads, so the event
loop never blocks. On CUDA each stage has its own thread and stream (`StageWorkers`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from models.aot import AotStore, PackageKey, device_name, weights_hash
from models.fidelity import load_photos
from models.optimize import EAGER_ON_RECOMPILE, OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.provenance import SYNTHETIC, weights_label
from models.sam import SAM_CONFIGS, load_sam
from models.sam import transforms as sam_tf
from models.sam2 import SAM2_CONFIGS, Sam2Encoder, default_decoder_paths, load_sam2
from models.sam2.automatic import Sam2AutomaticMaskSettings
from models.swin import SWIN_CONFIGS, WindowAttention, load_swin
from models.swin import transforms as swin_tf
from models.triton_device import runs_triton
from server.domain import (
    ClassifyResult,
    EmbeddingFile,
    EmbedResult,
    Image,
    ModelInfo,
    PromptMasks,
    SegmentRequest,
    SegmentResult,
)
from server.engine.batcher import Batcher, BatchObserver, GuardedObserver, WorkerLoad
from server.engine.build import (
    compile_cache_hits,
    optimize_options,
    resolve_device,
    resolve_kernels,
    swin_attention_form,
    swin_options,
    use_compile_cache,
    use_kernels,
    use_precision,
    variant_refusal,
)
from server.engine.cache import CacheObserver, EmbeddingCache, ImageEmbedding, LowResStore
from server.engine.everything import (
    EverythingMasks,
    EverythingRunner,
    GeneratorFactory,
    sam2_generators,
    sam_generators,
)
from server.engine.faults import Faults
from server.engine.fidelity import FidelityReport, measure_served
from server.engine.first_turn import first_turn, first_turn_folder, first_turn_key
from server.engine.sam2_stages import Sam2Stages
from server.engine.sam_service import SamParts, SamService
from server.engine.stages import (
    GRAPHED_SETS,
    ClassifyItem,
    DecodeItem,
    EncodeItem,
    SamStages,
    SwinStage,
    TopK,
)
from server.engine.swin_service import SwinParts, SwinService
from server.engine.workers import StageWorkers
from server.errors import ServiceError
from server.progress import StartupProgress
from server.settings import Settings
from server.settings_cli import sam2_problems, sam_model_names

log = logging.getLogger(__name__)

# photos of SERVE_CALIBRATION_IMAGES used at most: as many as the synthetic set's
CALIBRATION_PHOTOS = 8

Step = tuple[str, Callable[[], None]]  # a start-up step: its label and the worker's call


def calibration_inputs(
    settings: Settings,
    opts: OptimizeOptions,
    preprocess: Callable[[list[torch.Tensor]], torch.Tensor],
) -> torch.Tensor | None:
    """A model's inputs from SERVE_CALIBRATION_IMAGES (at most `CALIBRATION_PHOTOS`
    photos through the model's `preprocess`), for int8 and fp8 to calibrate on; None
    without the setting or without quantisation (synthetic images then:
    models.int8_select.smooth_images)."""
    folder = settings.calibration_images
    if folder is None or opts.quantization == "none":
        return None
    photos = load_photos(folder, CALIBRATION_PHOTOS)
    log.info("int8/fp8 calibrate on %d photos from %s", len(photos), folder)
    checked = settings.fidelity_images
    if settings.fidelity_check and checked is not None and checked.resolve() == folder.resolve():
        log.warning("SERVE_CALIBRATION_IMAGES and SERVE_FIDELITY_IMAGES are one folder: the "
                    "fidelity check measures on the photos int8/fp8 calibrated on, and its "
                    "figures flatter; give it other photos of the same kind")  # fmt: skip
    return preprocess(photos)


def _item_cost(item: object) -> int:
    """A batch item's cost as its batcher counts it: prompts for the decoder, else one."""
    return len(item.prompts) if isinstance(item, DecodeItem) else 1


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class Engine:
    """Owns the models and batchers; created and closed by the app's lifespan."""

    def __init__(self, settings: Settings, observer: BatchObserver | None = None) -> None:
        self.device = resolve_device(settings.device)
        settings = settings.for_device(self.device.type)  # batch sizes a laptop can hold
        self.settings = settings
        self.options = optimize_options(settings, self.device)
        self.swin_options = swin_options(settings, self.options, self.device)
        use_precision(self.options)
        self.kernels = resolve_kernels(settings, self.device)
        use_kernels(self.kernels)
        if self.device.type == "cuda":
            log.info("SERVE_KERNELS=%s: the %s kernels", settings.kernels, self.kernels)
        # RLE runs found on the GPU (one small copy back) rather than by pycocotools on the
        # host (whole masks copied back, then 10-30 ms of one core each, holding the GIL).
        self.rle_on_device = settings.mask_rle in ("low_res", "device") or (
            settings.mask_rle == "auto" and self.device.type == "cuda"
        )
        # ... and with one kernel launch straight from the low-res logits, where it runs
        if settings.mask_rle == "low_res" and not runs_triton(self.device):
            raise ValueError(
                "SERVE_MASK_RLE=low_res: its Triton kernel runs on CUDA only; "
                "use SERVE_MASK_RLE=device or host"
            )
        self.rle_from_low_res = self.rle_on_device and settings.mask_rle in ("low_res", "auto")
        # COCO's strings written beside those runs on the device, not by the frontends
        if settings.mask_strings == "device" and not self.rle_from_low_res:
            raise ValueError(
                "SERVE_MASK_STRINGS=device: the strings are written from the low-res runs, "
                "which need SERVE_MASK_RLE=low_res or auto on CUDA; use SERVE_MASK_STRINGS=host"
            )
        self.strings_on_device = self.rle_from_low_res and settings.mask_strings != "host"
        self.observer = observer or BatchObserver()
        self.workers = StageWorkers(self.device, settings.stage_threads, settings.encoder_sms)
        # start-up steps and the fidelity check: the encoder's thread (nothing else runs yet)
        self.worker = self.workers["sam_encoder"]
        self.cache = EmbeddingCache(
            settings.embedding_cache_bytes,
            host_bytes=settings.embedding_cache_host_bytes,
            device=self.device,
            observer=observer if isinstance(observer, CacheObserver) else None,
        )
        self.low_res = LowResStore(settings.low_res_cache_bytes)
        self.sam: SamParts | None = None
        self.swin: SwinParts | None = None
        self.warmup_seconds: float | None = None
        self.warm_released_bytes = 0  # what warm-up gave back to the device, bucket by bucket
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
            try:
                await loop.run_in_executor(self.worker, fn)
            except (RuntimeError, NotImplementedError) as exc:
                refusal = variant_refusal(self.settings, self.device, label, exc)
                if refusal is None:
                    raise
                raise refusal from exc
        await loop.run_in_executor(self.worker, self.workers.synchronize)

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
        # in aot mode the decoder is eager, replayed from CUDA graphs on a GPU (SamStages)
        decoder_eager = mode == "none" or (mode == "aot" and not self.options.cuda_graphs)
        decoder_doing = {"none": "checking", "aot": "capturing the CUDA graphs of"}.get(
            "none" if decoder_eager else mode, "compiling"
        )

        def warmed(buckets: list[int], eager: bool = not every) -> list[int]:
            return buckets[:1] if eager else buckets

        steps: list[Step] = []
        if s.enable_sam:
            for b in warmed(s.buckets_up_to(s.max_batch_size)):
                steps.append((f"{doing} the SAM encoder, batch {b}",
                              partial(self._warm, "sam_encoder", b)))  # fmt: skip
            decoder_buckets = s.buckets_up_to(s.decoder_max_batch_prompts)
            if mode == "aot" and not decoder_eager:  # eager code with graphs: only they need it
                decoder_buckets = [b for b in decoder_buckets if b <= GRAPHED_SETS]
            for b in warmed(decoder_buckets, decoder_eager):
                steps.append((f"{decoder_doing} the SAM decoder, {b} prompts",
                              partial(self._warm, "sam_decoder", b)))  # fmt: skip
            if s.sam_model in SAM2_CONFIGS and mode != "none":
                # with AOT packages that decoder call stays eager: its Triton kernels only
                points = Sam2AutomaticMaskSettings().points_per_batch
                what = f"compiling SAM 2's segment-everything decoder, {points} points"
                if mode == "aot":
                    what = "warming SAM 2's segment-everything kernels"
                steps.append((what, partial(self._warm, "everything", points)))
        if s.enable_swin:
            for b in warmed(s.buckets_up_to(s.classify_max_batch_size)):
                steps.append((f"{doing} Swin, batch {b}", partial(self._warm, "swin", b)))
        return steps

    def _warm(self, stage: str, bucket: int) -> None:
        """Warm one bucket, then give its transients back to the device.

        Each bucket's transients are larger than the last's and seldom fit the segments
        the smaller ones left cached, so kept they add up: an engine held 18.8 GB at the
        end of warm-up, 12.6 GB of it cached and unused, and eight engines warming at
        once on one H200 ran out of its 140 GB (docs/BENCHMARKS.md, issue 19, twenty-first
        session); six would not have fitted an 80 GB H100. Released bucket by bucket, an
        engine's peak is its models plus one bucket's transients.

        Each stage warms on its own stream, so the graphs it captures keep that stream's
        priority (`StageWorkers.on_stream`): captured on the warm-up thread's encoder
        stream, a click's decoder graphs ran at the encoder's priority.

        A quantised stage's bucket on a GPU is warmed by one engine of the host first, the
        others after it from the caches it filled (`server.engine.first_turn`)."""
        key = self._first_turn_key(stage, bucket)
        if key is None:
            self._warm_now(stage, bucket)
            return
        with first_turn(first_turn_folder(self.settings.compile_cache_dir), key):
            self._warm_now(stage, bucket)

    def _first_turn_key(self, stage: str, bucket: int) -> str | None:
        s = self.settings
        if stage == "sam_encoder":
            model, options = s.sam_model, self.options
        elif stage == "swin":
            model, options = s.swin_model, self.swin_options
        else:  # the decoders are not quantised
            return None
        return first_turn_key(
            stage, bucket, self.device, options.quantization, model, options.compile_mode
        )

    def _warm_now(self, stage: str, bucket: int) -> None:
        with self.workers.on_stream(stage):  # a stage of STAGES
            if stage == "swin":
                assert self.swin is not None
                self.swin.stage.warm(bucket)
            else:
                assert self.sam is not None
                if stage == "everything":
                    assert isinstance(self.sam.stages, Sam2Stages)
                    self.sam.stages.warm_everything(bucket)
                elif stage == "sam_encoder":
                    self.sam.stages.warm_encoder(bucket)
                else:
                    self.sam.stages.warm_decoder(bucket)
        self.warm_released_bytes += self.workers.release_cached()

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
        # called on the worker thread: a failing metric is logged, never fails the batch
        on_span = partial(GuardedObserver(self.observer).batch_gpu, stage)

        def run_batch(items: list[Any]) -> Any:
            with self._serving():
                started = self.workers.started()
                return self.workers.handed_over(run(items), started, on_span)

        return run_batch

    def _serving(self) -> AbstractContextManager[object]:
        """What a served call runs under: after a compiled warm-up, the no-recompile stance
        (see `_stage_fn`), held only for the call."""
        return EAGER_ON_RECOMPILE.hold() if self.no_recompile else nullcontext()

    def _batcher_args(self, stage: str) -> dict[str, object]:
        s = self.settings
        worker = self.workers[stage]
        return {
            "executor": worker,
            "load": WorkerLoad.of(worker),  # shared by the stages sharing the thread
            "max_delay_s": s.max_queue_delay_ms / 1000.0,
            "max_queue_size": s.max_queue_size,
            "observer": self.observer,
        }

    def _info(
        self,
        name: str,
        checkpoint: Path | None,
        buckets: list[int],
        opts: OptimizeOptions | None = None,
    ) -> ModelInfo:
        opts = opts or self.options
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
            kernels=self.kernels,
        )

    def _load_sam(self) -> SamParts:
        s = self.settings
        if s.sam_model in SAM2_CONFIGS:
            return self._load_sam2()
        if s.sam_model not in SAM_CONFIGS:
            raise ValueError(f"unknown SERVE_SAM_MODEL {s.sam_model!r}; one of {sam_model_names()}")
        config = SAM_CONFIGS[s.sam_model]
        opts = self.options
        model = load_sam(config, s.sam_checkpoint, seed=s.seed).to(self.device, opts.dtype)
        calibration = calibration_inputs(
            s, opts, lambda photos: sam_tf.preprocess_images(photos, config, "cpu")[0]
        )
        prepare_sam_encoder(model.image_encoder, opts, self.device, calibration)
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
            aot=self._aot_store(
                f"sam_{s.sam_model}", model.image_encoder, attention=opts.attention
            ),
            decoder_graphs=s.decoder_graphs, fused_runs=self.rle_from_low_res,
            device_strings=self.strings_on_device,
        )  # fmt: skip
        info = self._info(f"sam_{s.sam_model}", s.sam_checkpoint, encoder_buckets)
        return self._sam_parts(stages, info, sam_generators(model, info.name))

    def _load_sam2(self) -> SamParts:
        """SAM 2.1 through the same batchers and service as SAM (`Sam2Stages`, SAM 2's
        segment everything), fp32 eager on the CPU, bf16 and compiled on CUDA."""
        s = self.settings
        problems = sam2_problems(s)  # `python -m server` said so before; `build_app` callers
        if problems:
            raise ValueError("; ".join(problems))
        opts = self.options
        model = load_sam2(SAM2_CONFIGS[s.sam_model], s.sam_checkpoint, seed=s.seed)
        model = model.to(self.device, opts.dtype)
        model.use_decoder_paths(**default_decoder_paths(self.device))
        if s.sam_checkpoint is None:
            log.warning(
                "SAM 2 %s has seeded RANDOM weights (seed %d): masks mean nothing",
                s.sam_model,
                s.seed,
            )
        encoder_buckets = s.buckets_up_to(s.max_batch_size)
        stages = Sam2Stages(
            model, self.device, opts, encoder_buckets,
            s.buckets_up_to(s.decoder_max_batch_prompts), self.rle_on_device,
            work_bytes=s.everything_work_bytes, decoder_graphs=s.decoder_graphs,
            fused_runs=self.rle_from_low_res, aot=self._aot_store(s.sam_model, Sam2Encoder(model)),
            device_strings=self.strings_on_device,
        )  # fmt: skip
        # the name as Meta spells it (no "sam_" prefix: "sam2.1_hiera_tiny" says it)
        info = replace(
            self._info(s.sam_model, s.sam_checkpoint, encoder_buckets),
            attention="sdpa",
            precision=replace(opts, gelu_epilogue=False).variant,  # Hiera's GELU stays exact
        )
        generators = sam2_generators(model, info.name, stages.everything_decode)
        return self._sam_parts(stages, info, generators, sam2=True)

    def _sam_parts(
        self,
        stages: SamStages,
        info: ModelInfo,
        generators: GeneratorFactory,
        sam2: bool = False,
    ) -> SamParts:
        """The encoder's and decoder's batchers over `stages` and the segment-everything
        runner over the model's generator, SAM's or SAM 2's alike (the same bounds)."""
        s = self.settings
        everything = EverythingRunner(
            generators,
            self.workers["everything"],
            max_bytes=s.everything_max_bytes,
            max_concurrent=s.everything_max_concurrent,
            max_waiting=s.everything_max_waiting,
            max_masks=s.everything_max_masks,
            max_work_bytes=s.everything_work_bytes,
            rle_on_device=self.rle_on_device,
            serving=self._serving,
        )
        encoder: Batcher[EncodeItem, ImageEmbedding] = Batcher(
            "sam_encoder",
            self._stage_fn("sam_encoder", stages.encode),
            max_batch_cost=s.max_batch_size,
            **self._batcher_args("sam_encoder"),  # type: ignore[arg-type]
        )
        decoder: Batcher[DecodeItem, list[PromptMasks]] = Batcher(
            "sam_decoder",
            self._stage_fn("sam_decoder", stages.decode),
            max_batch_cost=s.decoder_max_batch_prompts,
            max_batch_memory=s.segment_max_bytes,
            **self._batcher_args("sam_decoder"),  # type: ignore[arg-type]
        )
        return SamParts(stages, info, encoder, decoder, everything, sam2=sam2)

    def _load_swin(self) -> SwinParts:
        s = self.settings
        if s.swin_model not in SWIN_CONFIGS:
            raise ValueError(
                f"unknown SERVE_SWIN_MODEL {s.swin_model!r}; one of {list(SWIN_CONFIGS)}"
            )
        config = SWIN_CONFIGS[s.swin_model]
        opts = self.swin_options
        form = swin_attention_form(s, self.device)
        model = load_swin(config, s.swin_checkpoint, seed=s.seed).to(self.device, opts.dtype)
        for module in model.modules():
            if isinstance(module, WindowAttention):
                module.form = form
        calibration = calibration_inputs(
            s, opts, lambda photos: swin_tf.preprocess_images(photos, config, "cpu")
        )
        prepare_swin(model, opts, calibration)
        if s.swin_checkpoint is None:
            log.warning(
                "Swin %s has seeded RANDOM weights (seed %d): labels mean nothing",
                s.swin_model,
                s.seed,
            )
        buckets = s.buckets_up_to(s.classify_max_batch_size)
        # the kernel or SDPA inside the package: keyed (the written-out form's packages
        # came first and keep their key)
        attention = {"kernel": "window_kernel", "sdpa": "window_sdpa"}.get(form, "sdpa")
        aot = self._aot_store(s.swin_model, model, attention, opts)
        stage = SwinStage(model, config, self.device, opts, buckets, aot=aot)
        info = self._info(s.swin_model, s.swin_checkpoint, buckets, opts)
        batcher: Batcher[ClassifyItem, TopK] = Batcher(
            "swin",
            self._stage_fn("swin", stage.classify),
            max_batch_cost=s.classify_max_batch_size,
            **self._batcher_args("swin"),  # type: ignore[arg-type]
        )
        return SwinParts(stage, info, batcher)

    def _aot_store(
        self,
        name: str,
        module: torch.nn.Module,
        attention: str = "sdpa",
        opts: OptimizeOptions | None = None,
    ) -> AotStore | None:
        """Where this model's AOT packages live, keyed by its weights and variant here, and
        by its attention where it is not SDPA's (another kernel inside the package)."""
        folder = self.settings.compile_cache_dir
        opts = opts or self.options
        if opts.compile_mode != "aot" or folder is None:
            return None
        variant = opts.variant + ("" if attention == "sdpa" else f"+{attention}_attention")
        key = PackageKey(name, weights_hash(module), variant, device_name(self.device))
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
        log.info("warm-up took %.2fs (compile cache %s; %.2f GB of transients given back"
                 " bucket by bucket)", self.warmup_seconds, self.compile_cache_events,
                 self.warm_released_bytes / 1e9)  # fmt: skip
        return self.warmup_seconds

    async def check_fidelity(self) -> FidelityReport:
        """Measure the served variant against the fp32 eager model (`models.fidelity`)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, self._check_fidelity_sync)

    def _check_fidelity_sync(self) -> FidelityReport:
        # served as requests are: after a compiled warm-up, nothing recompiles
        with self._serving():
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
        self.workers.shutdown()

    def models(self) -> list[ModelInfo]:
        return [p.info for p in (self.sam, self.swin) if p is not None]

    # -- requests: handed to the model's service ----------------------------------------

    def sam_service(self) -> SamService:
        if self.sam is None:
            raise ServiceError(503, "not_ready", "SAM is not enabled on this server")
        # the embedding download's copy back: a short job, on the segment-everything thread
        return SamService(
            self.sam, self.cache, self.low_res, self.settings, self.workers["everything"]
        )

    def swin_service(self) -> SwinService:
        if self.swin is None:
            raise ServiceError(503, "not_ready", "Swin is not enabled on this server")
        return SwinService(self.swin)

    async def embed(self, image: Image, deadline: float | None = None) -> EmbedResult:
        return await self.sam_service().embed(image, deadline)

    def lookup(self, image_id: str) -> EmbedResult:
        return self.sam_service().lookup(image_id)

    async def segment(self, request: SegmentRequest) -> SegmentResult:
        return await self.sam_service().segment(request)

    async def embedding_file(self, image_id: str) -> EmbeddingFile:
        return await self.sam_service().embedding_file(image_id)

    async def everything(
        self,
        image: Image | None,
        image_id: str | None,
        fields: dict[str, float | int],
        output: str = "rle",
        deadline: float | None = None,
    ) -> tuple[ImageEmbedding, EverythingMasks, dict[str, float]]:
        return await self.sam_service().everything(image, image_id, fields, output, deadline)

    async def classify(
        self, image: Image, top_k: int, deadline: float | None = None
    ) -> ClassifyResult:
        return await self.swin_service().classify(image, top_k, deadline)
