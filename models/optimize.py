"""Load-time optimization of a model for serving: precision, quantization, sparsity,
attention kernel, torch.compile and CUDA graphs, chosen by one `OptimizeOptions`.

The order matters and lives here once: cast to the serving dtype, swap Linear layers for
quantized or 2:4-sparse ones, pick the attention kernel, then compile. `GraphedBuckets`
then captures one CUDA graph per warmed batch-size bucket around the compiled function,
so a served batch costs one graph replay instead of hundreds of kernel launches.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor, nn

from models.cuda_graphs import warm_and_capture
from models.dynamo_import import preimported
from models.int8_select import calibration_on, calibration_run
from models.quantize import (
    QuantBackend,
    Quantization,
    gelu_epilogue,
    quantize_linears,
    quantize_linears_torchao,
    semi_structured_2to4,
)
from models.sam.attention import AttentionImpl
from models.sam.fused_attention import fused_supported

__all__ = [
    "DTYPES",
    "EAGER_ON_RECOMPILE",
    "CompileMode",
    "GraphedBuckets",
    "OptimizeOptions",
    "SharedStance",
    "compile_fn",
    "prepare_sam_encoder",
    "prepare_swin",
]

log = logging.getLogger(__name__)

# tf32: float32 weights and activations, matmuls on TF32 tensor cores (the engine sets
# `torch.set_float32_matmul_precision("high")`, server/engine/build.py `use_precision`)
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
CompileMode = Literal[
    "none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "aot"
]


@dataclass(frozen=True)
class OptimizeOptions:
    """What to do to a model at load time; `variant` names the result for clients."""

    precision: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    quantization: Quantization = "none"
    quantization_backend: QuantBackend = "core"  # "int_mm", "torchao": see models.quantize
    # core int8/fp8: the LayerNorm before qkv and the MLP writes their input quantised
    # (models.ln_quant); the server turns it on for int8 on CUDA (server/engine/build.py)
    norm_quant: bool = False
    # ... and the MLP's hidden activation goes from fc1 to fc2 quantised (models.mlp_hop)
    mlp_hop: bool = False
    # ... or by fixed per-channel scales calibrated at load (int8; models.mlp_static)
    mlp_static: bool = False
    # ... and SAM's attention adds its residual in the output projection's epilogue
    # (`Block.residual_in_proj`)
    proj_residual: bool = False
    # ... and SAM's output projections take their input by fixed per-channel scales too,
    # which the attention kernels write int8 (`Attention._proj_inv_scale`)
    proj_static: bool = False
    # int8/fp8: the share of quantised layers the per-layer choice may keep in float
    # (None: models.quantize.INT8_MAX_KEPT)
    keep_float: float | None = None
    sparsity: Literal["none", "2:4"] = "none"
    attention: AttentionImpl = "sdpa"  # the global blocks
    window_attention: AttentionImpl = "sdpa"  # the windowed blocks ("sdpa" or "triton")
    compile_mode: CompileMode = "none"
    cuda_graphs: bool = False
    # float MLPs of SAM's ViT encoder and Swin: GELU (tanh form) in the first GEMM's
    # cuBLASLt epilogue (models.quantize.GeluLinear); SAM 2's Hiera keeps its exact GELU
    gelu_epilogue: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def variant(self) -> str:
        """E.g. `bf16`, `bf16+fp8`, `bf16+int8+2:4`, `bf16+int8+torchao`: what every response's
        precision says."""
        parts: list[str] = [self.precision]
        if self.quantization != "none":
            parts.append(self.quantization)
            if self.quantization_backend != "core":
                parts.append(self.quantization_backend)
            # other graphs, other rounding: named (AOT packages are keyed by the variant)
            parts += [
                name
                for name, on in (
                    ("lnq", self.norm_quant),
                    ("hop", self.mlp_hop),
                    ("static", self.mlp_static),
                    ("pres", self.proj_residual),
                    ("pstatic", self.proj_static),
                )
                if on
            ]
            if self.keep_float is not None:  # other layers in float: another graph
                parts.append(f"keep{self.keep_float:g}")
        if self.gelu_epilogue:
            parts.append("tanh_gelu")  # other numbers, another AOT package
        if self.sparsity != "none":
            parts.append(self.sparsity)
        return "+".join(parts)


def _encoder_linear(name: str, layer: nn.Linear) -> bool:
    """The ViT blocks' qkv/proj/MLP layers: where the encoder's FLOPs are."""
    return name.startswith("blocks.")


def _encoder_mlp(name: str, layer: nn.Linear) -> bool:
    return name.startswith("blocks.") and ".mlp." in name


def prepare_sam_encoder(
    encoder: nn.Module,
    options: OptimizeOptions,
    device: torch.device,
    calibration: Tensor | None = None,
) -> None:
    """Quantize / sparsify the image encoder's blocks and choose its attention, in place.

    The prompt encoder and mask decoder stay in the serving dtype: they are small, and
    their outputs (mask logits near the threshold) are the most sensitive to rounding.
    `calibration`: pre-processed images (`[B, 3, S, S]`) to calibrate int8/fp8 on, in
    place of synthetic ones.
    """
    if options.sparsity == "2:4":
        compress = device.type == "cuda" and options.dtype != torch.float32
        semi_structured_2to4(encoder, _encoder_mlp, compress=compress)
    size = int(getattr(encoder, "img_size", 0))
    swapped = _quantize(encoder, options, _encoder_linear, size, calibration, True)
    if swapped:
        log.info(
            "SAM encoder: %d Linear layers quantized to %s", len(swapped), options.quantization
        )
    if options.gelu_epilogue:
        gelu_epilogue(encoder)
    for block in getattr(encoder, "blocks", []):
        # global blocks: the dense bias would be 4096^2 per head; windows: 196^2
        impl = options.attention if block.window == 0 else options.window_attention
        attn = block.attn
        grid = ((attn.rel_pos_h.shape[0] + 1) // 2, (attn.rel_pos_w.shape[0] + 1) // 2)
        if impl == "triton" and not fused_supported(grid, device):
            log.warning("SAM encoder: fused attention cannot run a %s grid here; SDPA", grid)
            impl = "sdpa"
        attn.impl = impl
        # the windows read in place: on an H100 with float qkv layers 409.8 img/s against
        # 401.4 partitioned; on an H200, since the kernel takes the padding's bias by its
        # constants, bf16 437.8 / 442.2 against 421.0 / 418.5 at batch 8 / 16 and int8
        # 472.8 / 476.8 against 466.0 / 471.5 (docs/BENCHMARKS.md, issue 20)
        block.windows_in_place = block.window > 0 and impl == "triton"
        block.residual_in_proj = options.proj_residual and options.quantization != "none"


def prepare_swin(
    model: nn.Module, options: OptimizeOptions, calibration: Tensor | None = None
) -> None:
    """Quantize the Swin blocks' Linear layers (not the classifier head), in place;
    `calibration`: pre-processed images to calibrate int8/fp8 on (else synthetic ones)."""

    def include(name: str, layer: nn.Linear) -> bool:
        return name.startswith("layers.") and ".blocks." in name

    config = getattr(model, "config", None)
    _quantize(model, options, include, int(getattr(config, "img_size", 0)), calibration, False)
    if options.gelu_epilogue:
        gelu_epilogue(model)


def _quantize(
    module: nn.Module,
    options: OptimizeOptions,
    include: Callable[[str, nn.Linear], bool],
    image_size: int,
    calibration: Tensor | None,
    padded: bool,
) -> list[str]:
    """int8 and fp8 measure each layer on 8 sample images and keep the worst in float
    (models.int8_select); fixed MLP scales are their largest values there (SAM's encoder:
    two images a call at 1024 px). SAM used 2 until fixed scales came: with 8 its masks
    met IoU 0.9922 against 0.9910 and the embedding error fell from 2.17% to 1.68% (random
    ViT-B weights on the photos, a CPU measurement: docs/BENCHMARKS.md, issue 20).
    `calibration`, pre-processed photos like the served ones, replaces the synthetic
    images: on those photos (mirrored) SAM's masks met IoU 0.996 (same measurement).
    `padded`: the model's inputs are photos padded to its square (SAM's encoders)."""
    if options.quantization_backend == "torchao":
        return quantize_linears_torchao(module, options.quantization, include)
    chunk = 2 if image_size >= 512 else None
    calibrate: Callable[[nn.Module], object] | None = None
    if calibration is not None:  # photos like the served ones (SERVE_CALIBRATION_IMAGES)
        calibrate = calibration_on(calibration, chunk)
    elif image_size:
        calibrate = calibration_run(image_size, 8, chunk=chunk, padded=padded)
    return quantize_linears(
        module, options.quantization, include,
        backend=options.quantization_backend, calibrate=calibrate,
        norm_quant=options.norm_quant, mlp_hop=options.mlp_hop, mlp_static=options.mlp_static,
        proj_static=options.proj_static, max_kept=options.keep_float,
    )  # fmt: skip


FnT = TypeVar("FnT", bound=Callable[..., Any])


def compile_fn(
    fn: FnT, mode: CompileMode, *, dynamic: bool | None, exact_casts: bool = False
) -> FnT:
    """torch.compile with one explicit line, or `fn` itself when compilation is off.
    `dynamic` as torch.compile's: None compiles static sizes but those marked dynamic.

    CUDA graphs are ours (`GraphedBuckets`), so the modes that would add their own graphs
    are mapped to their graph-free twins.

    `exact_casts`: inductor rounds each fused intermediate to the dtype eager would store it
    in (`emulate_precision_casts`) instead of keeping it in fp32 inside the kernel. Swin-T
    int8 compiled without it agreed with fp32 on 87.3% of top-1 labels, with it on 97.07%,
    eager's own figure; bf16 99.22% -> 99.41%, the served int8 99.02% -> 99.22%, at the same
    speed (H200, batch 256, docs/BENCHMARKS.md, issue 20).
    """
    if mode == "none":
        return fn
    if mode == "aot":  # packages are per shape (models.aot); this is the dynamic fallback
        raise ValueError("compile_fn cannot make AOT packages: use models.aot.AotBuckets")
    if mode == "reduce-overhead":
        mode = "default"
    if mode == "max-autotune":
        mode = "max-autotune-no-cudagraphs"
    preimported()
    if not exact_casts:
        return cast(FnT, torch.compile(fn, mode=mode, dynamic=dynamic, fullgraph=True))
    # torch.compile takes a mode or options, not both: the mode's own options, plus one
    options = {**torch._inductor.list_mode_options(mode, dynamic), "emulate_precision_casts": True}
    return cast(FnT, torch.compile(fn, options=options, dynamic=dynamic, fullgraph=True))


class SharedStance:
    """A torch.compile stance held only while some caller is inside `hold()`.

    The stance is process-wide state in torch. Set once and left, it reaches every other
    compiled function in the process (a second engine's warm-up, a test). Held around a
    call and put back after, it is scoped to that call; but two threads nesting plain
    `with torch.compiler.set_stance(...)` would each put back what it found, out of order,
    and could leave the stance set for good. So holders are counted: the first sets the
    stance, the last puts back what the first found.
    """

    def __init__(self, stance: str) -> None:
        self.stance = stance
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = contextlib.ExitStack()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._restore.enter_context(torch.compiler.set_stance(self.stance))
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._restore.close()


# After warm-up, a shape it did not meet runs eagerly instead of recompiling (see Engine).
EAGER_ON_RECOMPILE = SharedStance("eager_on_recompile")


class GraphedBuckets:
    """One CUDA graph per input shape, replayed with the inputs copied into static buffers.

    The graphs share one memory pool: they never run concurrently (one GPU worker thread),
    and each output is copied out by the caller before the next replay overwrites it.
    Shapes never captured run `fn` directly.
    """

    def __init__(self, fn: Callable[..., Tensor], *, enabled: bool) -> None:
        self.fn = fn
        self.enabled = enabled and torch.cuda.is_available()
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._graphs: dict[
            tuple[tuple[int, ...], ...], tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]
        ] = {}

    @staticmethod
    def _key(inputs: Sequence[Tensor]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.shape) for t in inputs)

    def capture(self, *inputs: Tensor, warmup_runs: int = 2) -> None:
        """Run `fn` a few times on a side stream (compiling it), then record a graph."""
        if not self.enabled:
            self.fn(*inputs)
            return
        static = [t.clone() for t in inputs]
        graph, out = warm_and_capture(lambda: self.fn(*static), self._pool, warmup_runs)
        self._graphs[self._key(static)] = (graph, static, out)

    def __call__(self, *inputs: Tensor) -> Tensor:
        entry = self._graphs.get(self._key(inputs))
        if entry is None:
            return self.fn(*inputs)
        graph, static, out = entry
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    @property
    def captured(self) -> list[tuple[tuple[int, ...], ...]]:
        return list(self._graphs)
