"""The one settings object of the service.

Read once (in `__main__` or by the caller of `build_app`) and passed down as a plain
argument, so no other module reads the environment and tests can build any configuration
without touching `os.environ`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# What a 2-core laptop can hold: on the CPU nothing is compiled, so bigger batches buy no
# throughput, while an encoder batch of 8 vit_b images held 12.1 GB (issue 21). Used where
# the setting was not given (`Settings.for_device`); --help names them with each field.
CPU_DEFAULTS: dict[str, int] = {
    "max_batch_size": 2,
    "classify_max_batch_size": 2,
    "decoder_max_batch_prompts": 64,
    "embedding_cache_bytes": 512 * 1024**2,
}


# Other spellings of the SAM 2.1 names: the issue's `b+` (Meta's file and yaml names) and
# the one-letter forms; a name is stored as the model registry's (`models.sam2`).
SAM_MODEL_ALIASES: dict[str, str] = {
    "sam2.1_hiera_t": "sam2.1_hiera_tiny",
    "sam2.1_hiera_s": "sam2.1_hiera_small",
    "sam2.1_hiera_b+": "sam2.1_hiera_base_plus",
    "sam2.1_hiera_l": "sam2.1_hiera_large",
}


def available_cores() -> int:
    """Cores this process may run on: its affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


class Settings(BaseSettings):
    """Every knob of the service; environment names are `SERVE_` + the field name."""

    # The docstring under each field is its description: `python -m server --help` lists them.
    model_config = SettingsConfigDict(
        env_prefix="SERVE_", extra="ignore", use_attribute_docstrings=True
    )

    # Models and device.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where the models run: auto (CUDA when a GPU is visible, else the CPU), cpu or cuda"""
    sam_model: str = "vit_b"
    """SAM encoder size: vit_b, vit_l, vit_h; SAM 2.1: sam2.1_hiera_tiny, _small, _base_plus
    (or _b+), _large (vit_tiny, sam2_test_tiny: tests and development)"""
    sam_checkpoint: Path | None = None
    """Meta's SAM .pth or SAM 2.1 .pt; unset: seeded random weights (masks mean nothing)"""
    swin_model: str = "swin_tiny_patch4_window7_224"
    """Swin classifier: swin_tiny_/small_/base_patch4_window7_224 (swin_test: tests)"""
    swin_checkpoint: Path | None = None
    """timm-format Swin .pth / .safetensors; unset: seeded random weights"""
    enable_sam: bool = True
    """load SAM (the /v1/segment, /v1/embed and everything routes)"""
    enable_swin: bool = True
    """load Swin (the /v1/classify route)"""
    seed: int = 0
    """seed of the random weights used when no checkpoint is given"""
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA
    """serving dtype: auto (bf16 on CUDA, fp32 on the CPU), fp32, tf32 (fp32 with TF32
    tensor-core matmuls: a CUDA GPU of compute capability 8.0 or newer), bf16, fp16"""
    quantization: Literal["none", "int8", "fp8"] = "none"  # SAM encoder and Swin blocks
    """int8 or fp8 (rowwise, Hopper) Linear layers in the SAM encoder and Swin blocks"""
    swin_quantization: Literal["same", "none", "int8", "fp8"] = "same"
    """Swin's own: same (as SERVE_QUANTIZATION), none, int8 or fp8; e.g. int8 SAM beside
    fp16 Swin"""
    # core: our layers (measured, docs/BENCHMARKS.md); torchao: torchao's quantize_ where it
    # is installed and can (fp8 needs CUDA 8.9+), else core with a warning
    quantization_backend: Literal["core", "torchao"] = "core"
    """core: our int8/fp8 layers; torchao: torchao's quantize_ where it can, else core"""
    # SAM's int8/fp8 encoder, two trades of mask fidelity for speed (docs/BENCHMARKS.md,
    # issue 20): unset / auto take both for ViT-B's int8 on CUDA (608.5 against 556.6
    # img/s, mask IoU 0.9863 against 0.9903 on an H100), neither elsewhere
    sam_keep_float: float | None = Field(None, ge=0.0, le=1.0)
    """int8/fp8 SAM: the share of the encoder's quantised layers that may stay in float,
    worst measured error first (unset: 0 for ViT-B int8 on CUDA, else 1/8); 0 keeps none"""
    sam_proj_scales: Literal["auto", "per_token", "fixed"] = "auto"
    """int8 SAM ViT: the attention output projections' input scales: per_token (measured
    each batch), fixed (calibrated at load; the attention kernels write int8) or auto
    (fixed for ViT-B on CUDA, else per_token)"""
    sparsity: Literal["none", "2:4"] = "none"  # SAM encoder MLPs (cuSPARSELt on CUDA)
    """2:4 prunes the SAM encoder MLPs (cuSPARSELt on CUDA; changes the outputs)"""
    # auto: GELU in the GEMM's epilogue for bf16/fp16 on CUDA (7-9% more img/s, SAM's
    # encoder and Swin on an H100; docs/BENCHMARKS.md, issue 20), the exact erf elsewhere
    mlp_gelu: Literal["auto", "exact", "epilogue"] = "auto"
    """the MLPs' GELU in SAM's ViT encoder and Swin: auto (epilogue for bf16/fp16 on CUDA,
    else exact), exact (erf, as trained), epilogue (tanh form inside the first GEMM)"""
    # auto: our Triton kernel for the global blocks on CUDA (docs/BENCHMARKS.md), else SDPA
    attention: Literal["auto", "sdpa", "flex", "triton"] = "auto"
    """SAM global attention: auto (triton on CUDA, sdpa on the CPU), sdpa, flex, triton"""
    # auto: the Gluon kernels on Hopper, where the int8 encoder ran 531.7 / 541.4 img/s at
    # batch 8 / 16 against 508.5 / 515.2 with Triton's (H100, docs/BENCHMARKS.md, issue 20)
    kernels: Literal["auto", "triton", "gluon"] = "auto"
    """SAM's attention and the int8 GEMMs on CUDA: auto (gluon on Hopper where Triton has
    Gluon, else triton), triton, gluon (warp-specialised Hopper kernels; sm_90 only)"""
    swin_attention: Literal["auto", "kernel", "matmul", "sdpa"] = "auto"
    """Swin's window attention: auto (kernel on CUDA, matmul elsewhere), kernel (one Triton
    kernel on the unrolled grid, models/swin/window_kernel.py; CUDA only), matmul (written
    out), sdpa"""
    compile_mode: Literal[
        "auto", "none", "default", "max-autotune", "max-autotune-no-cudagraphs", "aot"
    ] = "auto"  # auto: "default" on CUDA, "none" on the CPU
    """torch.compile mode: auto (default on CUDA, none on the CPU), none, default, max-autotune;
    aot: AOTInductor packages of the encoders in SERVE_COMPILE_CACHE_DIR (models/aot.py)"""
    cuda_graphs: bool = True  # one graph per warmed bucket (CUDA and compile only)
    """one CUDA graph per warmed batch bucket (CUDA with compile only)"""
    decoder_graphs: bool = True
    """CUDA graphs of the SAM and SAM 2 decoders per (sets, tokens) bucket (with cuda_graphs)"""
    compile_cache_dir: Path | None = None  # persistent inductor/triton caches (fast restarts)
    """folder for persistent inductor/Triton caches, so restarts skip most compilation"""

    # Batching.
    max_batch_size: int = Field(8, ge=1, le=256)
    """images per SAM encoder batch (CPU default: 2)"""
    # Swin-T computes a batch of 32 in about the time SAM's encoder takes for one image;
    # with 8 per batch, 2,000 classifications a second would be 250 batches a second
    # (docs/BENCHMARKS.md, issue 19).
    classify_max_batch_size: int = Field(32, ge=1, le=256)
    """images per classifier (Swin) batch (CPU default: 2)"""
    max_queue_delay_ms: float = Field(5.0, ge=0.0, le=10_000.0)
    """how long a batch waits to fill, in ms"""
    max_queue_size: int = Field(256, ge=1)
    """waiting items per stage before 429"""
    batch_buckets: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """batch sizes warmed (compiled) ahead, as a JSON list; batches are padded up to one"""
    decoder_max_batch_prompts: int = Field(256, ge=1)
    """prompt sets per mask-decoder call, across requests (CPU default: 64)"""
    request_timeout_s: float = Field(30.0, gt=0.0)
    """a request's deadline, s (X-Request-Timeout-Ms may shorten it, or lengthen it up to
    max_request_timeout_s; a late body: 408)"""
    max_request_timeout_s: float = Field(120.0, gt=0.0)
    """the longest deadline a request's X-Request-Timeout-Ms may ask for, s (a segment
    everything of 32x32 points on a small CPU needs more than the default)"""
    drain_timeout_s: float = Field(30.0, ge=0.0)
    """how long shutdown waits for accepted requests, s (keep it >= the request timeout)"""
    warmup: bool = True
    """warm up before ready: every bucket when compiled, else one small batch per stage"""
    embedding_cache_bytes: int = Field(2 * 1024**3, ge=0)
    """device memory for cached image embeddings (CPU default: 512 MiB)"""
    embedding_cache_host_bytes: int = Field(0, ge=0)  # second tier in pinned host memory
    """a second embedding-cache tier in pinned host memory (0: off)"""
    low_res_cache_bytes: int = Field(256 * 1024**2, ge=0)  # mask_input handles
    """memory for low_res_handle logits (mask_input), LRU"""
    # Full-size masks: one segment request's (prompts x masks x H x W) estimated memory, and
    # the masks of one decoder batch together; a request over it alone gets 413 up front.
    segment_max_bytes: int = Field(8 * 1024**3, ge=1)
    """estimated memory of one segment request's full-size masks; over it, 413 masks_too_large"""

    # Segment everything: bounds on memory and on concurrent jobs.
    everything_max_bytes: int = Field(4 * 1024**3, ge=1)  # estimated device peak per request
    """estimated device peak of one segment-everything request; over it, 413"""
    everything_max_concurrent: int = Field(1, ge=1)
    """segment-everything jobs running at once"""
    everything_max_waiting: int = Field(8, ge=0)
    """segment-everything jobs waiting before 429"""
    everything_max_masks: int = Field(200, ge=1)
    """masks one segment-everything request may return at most"""
    # float logits being upscaled at once (segment everything, and segment's full-size masks)
    everything_work_bytes: int = Field(256 * 1024**2, ge=1)
    """float logits upscaled at once (segment everything, and segment's full-size masks)"""

    calibration_images: Path | None = None  # .jpg/.png photos like the ones you serve
    """int8/fp8 calibrate on these photos (at most 8) instead of synthetic images: which
    layers stay in float, GPTQ rounding, bias correction, SAM's fixed MLP scales"""

    # Fidelity check at start-up, opt-in: after warm-up, the served variant (its compiled
    # stages) against the fp32 eager model on the same weights, over the photos in
    # `fidelity_images`; start-up fails when a measure is past its floor (models.fidelity).
    fidelity_check: bool = False
    """after warm-up, measure the served variant against fp32 eager; below a floor: no start"""
    fidelity_images: Path | None = None  # .jpg/.png photos like the ones you serve
    """the photos (.jpg/.png) the fidelity check runs on; required with the check"""
    fidelity_max_photos: int = Field(8, ge=1)
    """photos the fidelity check uses at most"""
    fidelity_swin_views: int = Field(256, ge=1)  # seeded crops and flips of the photos
    """seeded crops and flips of the photos Swin's check classifies"""
    fidelity_min_mask_iou: float = Field(0.95, ge=0.0, le=1.0)  # mean over all masks
    """floor: SAM's mean mask IoU against the fp32 model"""
    fidelity_max_embedding_error: float = Field(0.05, ge=0.0)  # relative, SAM's encoder
    """ceiling: SAM encoder's relative error against the fp32 model"""
    fidelity_min_top1_agreement: float = Field(0.99, ge=0.0, le=1.0)  # Swin
    """floor: Swin's top-1 agreement with the fp32 model"""

    # Limits on what a client may send.
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    """request body limit in bytes (413)"""
    max_image_pixels: int = Field(40_000_000, ge=1)
    """decoded image pixel limit (413)"""
    max_points: int = Field(64, ge=1)
    """points per request (422)"""
    max_boxes: int = Field(64, ge=1)
    """boxes per request (422)"""
    max_top_k: int = Field(100, ge=1)
    """largest top_k a classify request may ask (422)"""

    # Watchdog: a batch computing longer than this marks the worker stuck (/healthz 503).
    watchdog_timeout_s: float = Field(120.0, gt=0.0)
    """a batch computing longer than this (seconds) marks the worker stuck (/healthz 503)"""

    # Diagnosis of GPU memory: `kill -USR2` an engine logs its allocator's reserve per
    # stage stream (server.engine.gpu_memory); with this set it also records that many of
    # the allocator's latest events with their Python stacks and writes them beside the
    # log line as a snapshot for PyTorch's memory viz (costs host time per allocation).
    gpu_memory_history: int = Field(0, ge=0)
    """allocator events recorded with their stacks for `kill -USR2` (0: off; diagnosis)"""

    # Fault injection, for tests of failure handling only (see server/engine/faults.py).
    fault_oom_min_batch: int = Field(0, ge=0)
    """tests only: fail batches of at least this many items with out-of-memory (0: never)"""
    fault_oom_stage: str = ""
    """tests only: the stage the out-of-memory fault hits"""
    fault_hang_stage: str = ""
    """tests only: the stage whose batches hang"""
    fault_hang_s: float = Field(0.0, ge=0.0)
    """tests only: how long a hanging batch hangs, in seconds"""
    fault_raise_stage: str = ""
    """tests only: the stage whose batches raise a torch shape error"""
    # a batch holding an item of this cost (decoder: prompts) in fault_oom_stage fails a real
    # CPU allocation (RuntimeError), so the split finds that item; 0: never
    fault_alloc_min_cost: int = Field(0, ge=0)
    """tests only: an item of this cost in fault_oom_stage fails an allocation (0: never)"""
    fault_step_delay_s: float = Field(0.0, ge=0.0)
    """tests only: each start-up step waits this long first, so a test can watch warming"""

    # Access.
    api_key: str | None = None
    """when set, every route but the probes (and /metrics, by setting) needs this key"""
    metrics_require_key: bool = False
    """with an API key, /metrics needs it too"""
    cors_origins: list[str] = Field(default_factory=list)
    """allowed browser origins, as a JSON list (closed by default)"""

    # Processes: `python -m server` is a supervisor of one engine process (models, batchers,
    # caches) and this many frontend processes (HTTP, decoding, mask strings) sharing the
    # port. One process held everything once and its GIL capped the service at a third of
    # the encoder's speed and a tenth of the decoder's (issue 19, docs/BENCHMARKS.md).
    http_workers: int | None = Field(None, ge=1, le=64)
    """frontend (HTTP) processes (unset: the cores available minus one, 1 to 8)"""
    # A proxy in front (ingress-nginx, a cloud load balancer) keeps idle connections to the
    # pods for 60 s and reuses them; uvicorn closed them after 5 s, and a POST sent on one
    # just as it closed came back as the proxy's 502 (seen through nginx in
    # tests/deploy/test_affinity.py). The service must be the last to close an idle one.
    keep_alive_s: int = Field(75, ge=1, le=3600)
    """seconds an idle HTTP connection stays open (above the 60 s that ingress-nginx and
    cloud load balancers keep idle upstream connections)"""
    # One engine process per GPU, each seeing only its GPU (CUDA_VISIBLE_DEVICES): a
    # process drives one device, and each keeps its own embedding cache, so the frontends
    # send every call about an image to the engine that image hashes to (its `image_id`).
    engines: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """engine processes: auto (SERVE_ENGINES_PER_GPU per visible GPU, 1 without one), or a
    number (several on the CPU too; more than the GPUs share them round robin)"""
    # Several engines on one GPU: each a process of its own, with its own GIL, models and
    # cache (images hash between them as between GPUs). Under MPS the engines' host work,
    # not the GPU, bounded the README's mix: on an H200 with 16 cores its p99s fell from
    # 1,290 / 802 / 879 ms with two engines to 172 / 91 / 113 with six (docs/BENCHMARKS.md,
    # issue 19, nineteenth session); time-sliced, two held it where one collapsed. A MIG
    # instance is too small to hold two. The rule is `server.gpus.engines_on`.
    engines_per_gpu: Annotated[int, Field(ge=1, le=8)] | Literal["auto"] = "auto"
    """engines on each GPU with SERVE_ENGINES=auto: auto (under the service's own MPS
    server one per two of the host's cores for that GPU, 2 to 6, with SAM vit_b or smaller;
    otherwise 2 per whole GPU; 1 per MIG instance) or a number"""
    # Engines sharing a GPU are separate CUDA contexts, which the GPU time-slices: a click
    # waited for the other engine's encoder batch and the README's mix collapsed; as
    # clients of one MPS server their kernels run side by side (server/mps.py).
    mps: Literal["auto", "on", "off"] = "auto"
    """an MPS server for engines sharing a GPU: auto (start a private one when a GPU hosts
    two or more engines and nvidia-cuda-mps-control is there), on (refuse to start
    without), off"""
    # Each frontend decodes into a file of this size in /dev/shm that the engine maps (and
    # page-locks on CUDA): pixels reach the GPU without a copy or a pickle. An image that
    # does not fit travels inline with its call instead (one copy more); none is refused.
    shm_bytes_per_worker: int = Field(128 * 1024**2, ge=0)
    """bytes of shared memory per frontend for decoded images (0: send pixels inline)"""
    # libjpeg-turbo's DCT scaling: a 4000x3000 photo for SAM (1024) decodes at 1/2 and for
    # Swin at 1/8, for less work and fewer pixels to move; the model's input keeps its size
    # but its pixels differ slightly (mask IoU 0.98-0.99 against a whole decode,
    # docs/BENCHMARKS.md). False: every image decoded whole, as Meta's predictor sees it.
    scaled_decode: bool = True
    """decode JPEGs at 1/2, 1/4 or 1/8 when the model's resize needs no more pixels"""
    # nvJPEG on the GPU decodes a baseline JPEG for about a tenth of the host CPU time a
    # frontend spends on it (docs/BENCHMARKS.md); SAM's uploads gain from it, and Swin's
    # where its stage resizes them in batches (`server.engine.jpeg.models_for`);
    # rotated and non-JPEG images are always decoded by the frontends
    jpeg_decode: Literal["auto", "engine", "frontend"] = "auto"
    """where baseline JPEGs are decoded: auto (on the engine's GPU when nvJPEG works: SAM's,
    and Swin's where Triton resizes them in batches; the rest in the frontends), engine
    (all; refuse to start without nvJPEG; a CPU engine decodes itself), frontend (all
    there)"""
    # A progressive JPEG costs a frontend about three times the host CPU nvJPEG's own
    # (host) Huffman decoder takes in the engine (server/http/jpeg_pass.py has the
    # figures). In the service, six engines on an H200, classify @2,000 with the one
    # progressive photo of seven: p99 100.6 ms with the engines decoding it against
    # 4,203 ms with the frontends, on one machine; 55.8 ms on another (docs/BENCHMARKS.md,
    # issue 19, twenty-first session).
    jpeg_progressive: Literal["frontend", "engine"] = "engine"
    """where progressive JPEGs are decoded when the engine decodes that model's baseline
    ones: frontend, or engine (nvJPEG, its Huffman decoding on the engine's cores)"""
    decode_threads: int = Field(4, ge=1)
    """threads decoding images and encoding masks off the event loop, per frontend"""
    mask_rle: Literal["auto", "low_res", "device", "host"] = "auto"
    """where masks become RLE runs: low_res (on the device, straight from the decoder's
    low-res logits, one Triton kernel per image size; CUDA only), device (the full-size masks
    made on the device, then their runs there), host (the masks copied back, pycocotools);
    auto: low_res on CUDA, host on the CPU"""
    # A noise mask's string took a frontend 1.6 ms of pycocotools under its GIL (H200), and its
    # run lengths were 322 KB on the socket as uint16 against its string's 206 KB (issue 19).
    mask_strings: Literal["auto", "device", "host"] = "auto"
    """where COCO's counts strings are written: device (beside the low_res runs, two more
    kernel launches a decoder batch; the frontends pass them on), host (the frontends, with
    pycocotools, from the run lengths); auto: device wherever the runs are low_res"""
    # One thread and CUDA stream per stage lets a click's decoder batch run beside an
    # encoder batch (the decoder's stream at a higher priority) instead of queueing behind
    # it. On the CPU the stages' ops share the same cores, so one thread serves them all.
    stage_threads: Literal["auto", "one", "per_stage"] = "auto"
    """GPU work threads: per_stage (a thread and CUDA stream per stage), one, or auto
    (per_stage on CUDA, one on the CPU)"""
    # Priority orders the blocks waiting for an SM but frees none: beside encoder batches a
    # click's decoder batch waits for their blocks to end (6.9 ms of GPU against 2.1 alone
    # in the mix, H100). Encoders kept to a CUDA green context of fewer SMs leave the rest
    # free for decoder and classifier kernels (docs/BENCHMARKS.md, issue 19).
    encoder_sms: int = Field(0, ge=0)
    """SMs the encoder stages (SAM's encoder, segment-everything) may use, through a CUDA
    green context shared by every engine on the GPU; 0: all of them. CUDA only; Hopper
    hands out SMs in groups of 8, so a multiple of 8 is what runs exactly"""
    # Python's GIL hand-over interval. PyTorch releases the GIL around every op, so the
    # worker thread hands it over hundreds of times a batch and, beside busy Python threads,
    # waits up to this long each time to get it back. With 6 busy threads a tiny SAM's
    # encoder call took 7.6 s at Python's 5 ms and 0.96 s at 0.5 ms (31 ms alone; CPU,
    # bench/gil_contention.py, docs/BENCHMARKS.md). But the GPU service at 0.5 ms served
    # 57.9 req/s, against 57.9 to 75.8 in four runs at Python's 5 ms (H100, batch 16, 5 ms
    # delay), no gain, in the one-process service. The engine process has two busy threads,
    # its event loop (every call's messages) and the worker: on an H100 (2026-11-24) at
    # 0.2 ms its Swin batches took 9.9 ms (5 images) against 17.8 ms (6.5) at 5 ms, and
    # clicks at 100/s had p99 85 ms against 445, one run each (docs/BENCHMARKS.md). Applied
    # in the engine process only; frontends keep Python's 5 ms.
    switch_interval_ms: float = Field(0.2, gt=0.0)
    """the engine process's GIL hand-over interval in ms (Python's own is 5)"""
    # A thread waiting for its stream spins on a core by CUDA's default; with several
    # engines on a GPU, each with a waiting thread per stage, the spinning starved the
    # frontends on the same cores, so auto is blocking (server/engine/cuda_wait.py has
    # the figures).
    cuda_wait: Literal["auto", "spin", "yield", "blocking"] = "auto"
    """how engine threads wait for the GPU: auto (blocking), spin (CUDA's own default),
    yield (spin, giving the core to other threads) or blocking (sleep until it is done)"""
    log_level: str = "INFO"
    """log level of the JSON logs (DEBUG shows the probes' access lines)"""

    def frontends(self) -> int:
        """`http_workers`, or the cores this process may use minus one (for the engine),
        1 to 8: cgroup CPU quotas (a pod's limit) count, not only the host's cores."""
        if self.http_workers is not None:
            return self.http_workers
        return max(1, min(8, available_cores() - 1))

    @field_validator("sam_model")
    @classmethod
    def _canonical_sam_model(cls, value: str) -> str:
        """`sam2.1_hiera_b+` and the one-letter SAM 2.1 names become the registry's."""
        return SAM_MODEL_ALIASES.get(value, value)

    @field_validator("batch_buckets")
    @classmethod
    def _sorted_buckets(cls, value: list[int]) -> list[int]:
        """Buckets are searched in order, so keep them sorted, unique and positive."""
        buckets = sorted({int(b) for b in value})
        if not buckets or buckets[0] < 1:
            raise ValueError("batch_buckets must hold positive integers")
        return buckets

    @model_validator(mode="after")
    def _fidelity_needs_photos(self) -> Settings:
        """Asking for the check without photos would pass it on nothing: refuse instead."""
        if self.fidelity_check and self.fidelity_images is None:
            raise ValueError(
                "SERVE_FIDELITY_CHECK needs SERVE_FIDELITY_IMAGES (a folder of photos)"
            )
        return self

    @model_validator(mode="after")
    def _sam_trades_need_their_quantisation(self) -> Settings:
        """Fixed projection scales are an int8 form of the core layers, and the layers kept
        in float the core layers' per-layer choice: asked for with anything else, either
        would be quietly ignored."""
        if self.sam_proj_scales == "fixed" and (
            self.quantization != "int8" or self.quantization_backend != "core"
        ):
            raise ValueError(
                "SERVE_SAM_PROJ_SCALES=fixed needs SERVE_QUANTIZATION=int8 and "
                "SERVE_QUANTIZATION_BACKEND=core"
            )
        if self.sam_keep_float is not None and (
            self.quantization == "none" or self.quantization_backend != "core"
        ):
            raise ValueError(
                "SERVE_SAM_KEEP_FLOAT needs SERVE_QUANTIZATION=int8 or fp8 and "
                "SERVE_QUANTIZATION_BACKEND=core (the layers kept are that choice's)"
            )
        trades = {
            "SERVE_SAM_PROJ_SCALES=fixed": self.sam_proj_scales == "fixed",
            "SERVE_SAM_KEEP_FLOAT": self.sam_keep_float is not None,
        }
        asked = [name for name, on in trades.items() if on]
        if asked and self.sam_model.startswith("sam2"):  # Hiera is served unquantised
            raise ValueError(
                f"{' and '.join(asked)}: for SAM's ViT encoders (vit_b, vit_l, vit_h), not "
                f"SAM 2's Hiera ({self.sam_model}), which is not quantised"
            )
        return self

    @model_validator(mode="after")
    def _aot_needs_a_folder(self) -> Settings:
        """Packages built at every start would cost more than compiling: keep them."""
        if self.compile_mode == "aot" and self.compile_cache_dir is None:
            raise ValueError("SERVE_COMPILE_MODE=aot needs SERVE_COMPILE_CACHE_DIR (a folder)")
        return self

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, value: str | None) -> str | None:
        """An empty `SERVE_API_KEY=` in a manifest means no key, not the empty key."""
        return value or None

    def buckets_up_to(self, limit: int) -> list[int]:
        """The warmed batch sizes for a stage whose batches never exceed `limit`.

        The largest bucket is always `limit` itself so a full batch needs no padding.
        """
        buckets = [b for b in self.batch_buckets if b < limit]
        return [*buckets, limit]

    def for_device(self, device_type: str) -> Settings:
        """These settings with the CPU's defaults where none was given (`CPU_DEFAULTS`).

        Applied by the engine once the device is known, so `auto` devices get them too and
        a value given in the environment or by the caller always wins.
        """
        if device_type != "cpu":
            return self
        update = {k: v for k, v in CPU_DEFAULTS.items() if k not in self.model_fields_set}
        return self.model_copy(update=update) if update else self
