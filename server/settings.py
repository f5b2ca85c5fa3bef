"""The one settings object of the service.

Read once (in `__main__` or by the caller of `build_app`) and passed down as a plain
argument, so no other module reads the environment and tests can build any configuration
without touching `os.environ`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of the service; environment names are `SERVE_` + the field name."""

    model_config = SettingsConfigDict(env_prefix="SERVE_", extra="ignore")

    # Models and device.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sam_model: str = "vit_b"
    sam_checkpoint: Path | None = None
    swin_model: str = "swin_tiny_patch4_window7_224"
    swin_checkpoint: Path | None = None
    enable_sam: bool = True
    enable_swin: bool = True
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA
    quantization: Literal["none", "int8", "fp8"] = "none"  # SAM encoder and Swin blocks
    # core: our layers (measured, docs/BENCHMARKS.md); torchao: torchao's quantize_ where it
    # is installed and can (fp8 needs CUDA 8.9+), else core with a warning
    quantization_backend: Literal["core", "torchao"] = "core"
    sparsity: Literal["none", "2:4"] = "none"  # SAM encoder MLPs (cuSPARSELt on CUDA)
    # auto: our Triton kernel for the global blocks on CUDA (docs/BENCHMARKS.md), else SDPA
    attention: Literal["auto", "sdpa", "flex", "triton"] = "auto"
    compile_mode: Literal[
        "auto", "none", "default", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "auto"  # auto: "default" on CUDA, "none" on the CPU
    cuda_graphs: bool = True  # one graph per warmed bucket (CUDA and compile only)
    compile_cache_dir: Path | None = None  # persistent inductor/triton caches (fast restarts)
    # CUDA only: decoded images waiting for the GPU held in page-locked memory, up to this
    # many bytes at once, so the worker's upload is an async DMA copy (models.images). 0: off.
    pinned_image_bytes: int = Field(1024**3, ge=0)

    # Batching.
    max_batch_size: int = Field(8, ge=1, le=256)
    max_queue_delay_ms: float = Field(5.0, ge=0.0, le=10_000.0)
    max_queue_size: int = Field(256, ge=1)
    batch_buckets: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    decoder_max_batch_prompts: int = Field(256, ge=1)
    request_timeout_s: float = Field(30.0, gt=0.0)
    # The most a request's X-Request-Timeout-Ms may ask for: a header may shorten the deadline
    # or lengthen it up to this (a segment-everything of 32x32 points on a small CPU needs
    # more than the default); never below request_timeout_s.
    max_request_timeout_s: float = Field(120.0, gt=0.0)
    drain_timeout_s: float = Field(30.0, ge=0.0)
    warmup: bool = True
    embedding_cache_bytes: int = Field(2 * 1024**3, ge=0)
    embedding_cache_host_bytes: int = Field(0, ge=0)  # second tier in pinned host memory
    low_res_cache_bytes: int = Field(256 * 1024**2, ge=0)  # mask_input handles
    # Full-size masks: one segment request's (prompts x masks x H x W) estimated memory, and
    # the masks of one decoder batch together; a request over it alone gets 413 up front.
    segment_max_bytes: int = Field(8 * 1024**3, ge=1)

    # Segment everything: bounds on memory and on concurrent jobs.
    everything_max_bytes: int = Field(4 * 1024**3, ge=1)  # estimated device peak per request
    everything_max_concurrent: int = Field(1, ge=1)
    everything_max_waiting: int = Field(8, ge=0)
    everything_max_masks: int = Field(200, ge=1)
    # float logits being upscaled at once (segment everything, and segment's full-size masks)
    everything_work_bytes: int = Field(256 * 1024**2, ge=1)

    # Fidelity check at start-up, opt-in: after warm-up, the served variant (its compiled
    # stages) against the fp32 eager model on the same weights, over the photos in
    # `fidelity_images`; start-up fails when a measure is past its floor (models.fidelity).
    fidelity_check: bool = False
    fidelity_images: Path | None = None  # .jpg/.png photos like the ones you serve
    fidelity_max_photos: int = Field(8, ge=1)
    fidelity_swin_views: int = Field(256, ge=1)  # seeded crops and flips of the photos
    fidelity_min_mask_iou: float = Field(0.95, ge=0.0, le=1.0)  # mean over all masks
    fidelity_max_embedding_error: float = Field(0.05, ge=0.0)  # relative, SAM's encoder
    fidelity_min_top1_agreement: float = Field(0.99, ge=0.0, le=1.0)  # Swin

    # Limits on what a client may send.
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    max_image_pixels: int = Field(40_000_000, ge=1)
    max_points: int = Field(64, ge=1)
    max_boxes: int = Field(64, ge=1)
    max_top_k: int = Field(100, ge=1)

    # Watchdog: a batch computing longer than this marks the worker stuck (/healthz 503).
    watchdog_timeout_s: float = Field(120.0, gt=0.0)

    # Fault injection, for tests of failure handling only (see server/faults.py).
    fault_oom_min_batch: int = Field(0, ge=0)
    fault_oom_stage: str = ""
    fault_hang_stage: str = ""
    fault_hang_s: float = Field(0.0, ge=0.0)
    fault_raise_stage: str = ""
    # a batch holding an item of this cost (decoder: prompts) in fault_oom_stage fails a real
    # CPU allocation (RuntimeError), so the split finds that item; 0: never
    fault_alloc_min_cost: int = Field(0, ge=0)

    # Access.
    api_key: str | None = None
    metrics_require_key: bool = False
    cors_origins: list[str] = Field(default_factory=list)

    # Process.
    decode_threads: int = Field(4, ge=1)
    mask_rle: Literal["auto", "device", "host"] = "auto"  # auto: device on CUDA
    # Python's GIL hand-over interval. PyTorch releases the GIL around every op, so the
    # worker thread hands it over hundreds of times a batch and, beside busy Python threads,
    # waits up to this long each time to get it back. With 6 busy threads a tiny SAM's
    # encoder call took 7.6 s at Python's 5 ms and 0.96 s at 0.5 ms (31 ms alone; CPU,
    # bench/gil_contention.py, docs/BENCHMARKS.md). But the GPU service at 0.5 ms served
    # 57.9 req/s, against 57.9 to 75.8 in four runs at Python's 5 ms (H100, batch 16, 5 ms
    # delay): no gain shown where it matters, so None (Python's default) stays the default.
    switch_interval_ms: float | None = Field(None, gt=0.0)
    log_level: str = "INFO"

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
