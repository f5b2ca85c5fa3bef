"""The engine's build decisions: the device, the optimisations it resolves `auto` to, and
inductor's persistent caches. Pure functions of the settings, shared by the engine process
and `python -m server compile`.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from models.optimize import OptimizeOptions
from models.quantize import Quantization, torchao_unsupported
from models.sam.fused_attention import triton_available
from models.swin.window_kernel import kernel_compiles
from models.triton_device import gluon_unsupported
from server.settings import Settings

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` means CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("SERVE_DEVICE=cuda but no CUDA device is visible")
    return torch.device(name)


def optimize_options(
    settings: Settings, device: torch.device, quantization: Quantization | None = None
) -> OptimizeOptions:
    """Resolve the `auto` settings for the device: bf16, compiled, flex, graphed on CUDA.
    `quantization` in place of SERVE_QUANTIZATION (Swin's own, `swin_options`)."""
    cuda = device.type == "cuda"
    kind: Quantization = settings.quantization if quantization is None else quantization
    compile_mode = settings.compile_mode
    if compile_mode == "auto":
        compile_mode = "default" if cuda else "none"
    attention = settings.attention
    if attention == "auto":
        # FlexAttention avoids the dense bias but measured 3.5x slower than SDPA with it on
        # an H100 with torch 2.11; our Triton kernel avoids it without that cost
        # (docs/BENCHMARKS.md). Blocks whose grid the kernel cannot run keep SDPA.
        # AOT packages too: built with the kernel inside (its traceable twin,
        # models.sam.fused_attention) the encoder's package ran at 407.6 img/s on an H100
        # against 283.3 with SDPA's dense bias and 408.6 compiled, at the same fidelity
        # (docs/BENCHMARKS.md, issue 19, twenty-second session).
        attention = "triton" if cuda and triton_available() else "sdpa"
    precision = settings.precision
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    if precision == "tf32":
        check_tf32(device)
    gelu_epilogue = settings.mlp_gelu == "epilogue"
    if settings.mlp_gelu == "auto":
        # cuBLASLt's GELU epilogue: SAM's ViT-B encoder 353 -> 377 img/s, Swin-T 10,789 ->
        # 11,770 on an H100 at the same fidelity (docs/BENCHMARKS.md, issue 20); fp32 keeps
        # the exact erf (it exists for fidelity), and the CPU gains nothing from it
        gelu_epilogue = cuda and precision in ("bf16", "fp16")
    backend = settings.quantization_backend
    if backend == "torchao" and kind != "none":
        why_not = torchao_unsupported(kind, device)
        if why_not is not None:
            log.warning("SERVE_QUANTIZATION_BACKEND=torchao: %s; core torch's %s layers "
                        "instead", why_not, kind)  # fmt: skip
            backend = "core"
    # SAM's two trades of mask fidelity for speed (SERVE_SAM_PROJ_SCALES,
    # SERVE_SAM_KEEP_FLOAT), left unset: taken where they were measured, ViT-B's int8
    # encoder on CUDA with the core layers asked for (torchao's fallback to core keeps the
    # closer form). There fixed projection scales (3x headroom, written int8 by the
    # attention kernels) and no layer in float ran 608.5 img/s at batch 32 against 556.6,
    # mask IoU 0.9863 against 0.9903 (H100; the floor is 0.98); through the service
    # segment @600 answered 499.0 a second against 465.5 (docs/BENCHMARKS.md, issue 20)
    asked_core = settings.quantization_backend == "core"
    traded = cuda and kind == "int8" and asked_core and settings.sam_model == "vit_b"
    scales = settings.sam_proj_scales
    proj_static = (kind == "int8" and scales == "fixed") or (scales == "auto" and traded)
    keep_float = settings.sam_keep_float
    if keep_float is None and traded:
        keep_float = 0.0
    return OptimizeOptions(
        precision=precision,
        quantization=kind,
        quantization_backend=backend,
        sparsity=settings.sparsity,
        attention=attention,
        # the windows gain too (321 vs 306 img/s at batch 8 on an H100, docs/BENCHMARKS.md)
        window_attention="triton" if attention == "triton" else "sdpa",
        compile_mode=compile_mode,
        # eager code is not graphed; AOT packages are (loaded single-threaded, models.aot)
        cuda_graphs=settings.cuda_graphs and cuda and compile_mode != "none",
        # int8 on a GPU: the layer norms write the next GEMM's quantised input. Swin-T on
        # an H100: 10,700 img/s at 99.41% top-1 agreement, where quantising in each GEMM
        # measured 10,570 at 89.3% (docs/BENCHMARKS.md, issue 20)
        norm_quant=cuda and kind == "int8" and backend == "core",
        # ... and SAM's MLPs hand lin2 its input int8 by fixed per-channel scales
        # calibrated at load (models.mlp_static): the ViT-B encoder 469.5 / 474.6 img/s
        # against 444.1 / 445.1 at batch 8 / 16 on an H200, mask IoU 0.9845 against 0.988
        # with scales from 2 images and no headroom; from 8 with 1.5x headroom (served now)
        # as good as per-token scales on the CPU (docs/BENCHMARKS.md, issue 20, fifteenth
        # session). Swin keeps per-token scales (`swin_options`): it was not measured so.
        mlp_static=cuda and kind == "int8" and backend == "core",
        # ... and their attention's output projection adds the block's residual in its
        # epilogue, where a pass of its own added it: 493.1 / 497.8 img/s against 479.9 /
        # 484.8 at batch 8 / 16 on an H200, mask IoU 0.9877 against 0.9878
        # (docs/BENCHMARKS.md, issue 20, eighteenth session)
        proj_residual=cuda and kind == "int8" and backend == "core",
        proj_static=proj_static,
        keep_float=keep_float,
        gelu_epilogue=gelu_epilogue,
    )


def swin_options(
    settings: Settings, options: OptimizeOptions, device: torch.device
) -> OptimizeOptions:
    """Swin's own quantisation where SERVE_SWIN_QUANTIZATION names one, and its own
    precision where `SERVE_PRECISION=auto` chose bf16: fp16.

    Swin-T's top-1 agreement with fp32 on 1,024 views of the photos, H100, batch 256, the
    window kernel: bf16 99.32% at 20,990 img/s, fp16 99.90% at 21,040; with int8 layers
    bf16 99.32% at 16,260, fp16 99.80% at 16,130 (docs/BENCHMARKS.md, issue 20,
    2026-11-27). bf16's 7-bit mantissa moves labels whose logits are close; fp16's 10 bits
    keep them, and Swin's activations stay far inside fp16's range. SAM keeps bf16 (its
    masks are measured in bf16; fp16 was not measured there). A precision set explicitly
    is both models'. Swin's MLPs keep per-token int8 scales: fixed ones
    (`OptimizeOptions.mlp_static`) were measured on SAM only."""
    own = settings.swin_quantization
    if own != "same" and own != options.quantization:
        options = optimize_options(settings, device, own)
    options = replace(  # SAM's blocks and SAM's settings only
        options, mlp_static=False, proj_residual=False, proj_static=False, keep_float=None
    )
    if settings.precision == "auto" and options.precision == "bf16":
        return replace(options, precision="fp16")
    return options


def swin_attention_form(settings: Settings, device: torch.device) -> str:
    """`SERVE_SWIN_ATTENTION` resolved for the device: the form every WindowAttention runs
    in. `auto` is the kernel where it compiles: Swin-T 23,204 img/s against 13,090 written
    out on an H200 (bf16, batch 256, docs/BENCHMARKS.md, issue 20's tenth session). The
    kernel asked for where it cannot run is refused at start, naming the setting."""
    form = settings.swin_attention
    if form == "auto":
        return "kernel" if kernel_compiles(device) else "matmul"
    if form == "kernel" and not kernel_compiles(device):
        where = "a CUDA device without Triton" if device.type == "cuda" else str(device)
        raise VariantUnsupportedError(
            f"SERVE_SWIN_ATTENTION=kernel cannot run on this device ({where}): the window "
            "kernel is a Triton kernel for CUDA GPUs. Use auto (the kernel on CUDA, the "
            "written-out form elsewhere), matmul or sdpa."
        )
    return form


def resolve_kernels(settings: Settings, device: torch.device) -> Literal["triton", "gluon"]:
    """`SERVE_KERNELS` resolved for the device. `auto` is the Gluon kernels where they run
    (Hopper, a Triton with Gluon): the int8 encoder 531.7 / 541.4 img/s at batch 8 / 16
    against 508.5 / 515.2 with the Triton kernels, the same masks (H100, docs/BENCHMARKS.md,
    issue 20). `gluon` asked for where they cannot run is refused at start, naming the
    setting."""
    if settings.kernels == "triton":
        return "triton"
    why = gluon_unsupported(device)
    if settings.kernels == "auto":
        return "gluon" if why is None else "triton"
    if why is not None:
        raise VariantUnsupportedError(
            f"SERVE_KERNELS=gluon cannot run on this device: {why}. Use auto (the Gluon "
            "kernels on Hopper, Triton's elsewhere) or triton."
        )
    return "gluon"


def use_kernels(kernels: Literal["triton", "gluon"]) -> None:
    """The process-wide switches the kernels' launches read: the int8 GEMMs
    (`gemm_persistent.GLUON`, SAM's and Swin's) and SAM's global and windowed attention
    (`fused_attention.GLUON_GLOBAL`, `GLUON_WINDOW`). The engine process serves one choice;
    each launch falls back to the Triton kernel for a shape the Gluon one does not take, and
    traced launches (AOT packages) keep the Triton kernels."""
    from models import gemm_persistent
    from models.sam import fused_attention

    on = kernels == "gluon"
    gemm_persistent.GLUON = on
    fused_attention.GLUON_GLOBAL = on
    fused_attention.GLUON_WINDOW = on


def check_tf32(device: torch.device) -> None:
    """Refuse `SERVE_PRECISION=tf32` where no TF32 tensor core exists (the CPU, GPUs before
    Ampere): there it would quietly serve plain fp32 under another name."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return
        where = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    else:
        where = str(device)
    raise VariantUnsupportedError(
        f"SERVE_PRECISION=tf32 cannot run on this device ({where}): TF32 matmuls need a CUDA "
        "GPU of compute capability 8.0 or newer. Use SERVE_PRECISION=fp32 for the same "
        "arithmetic without tensor cores, or auto."
    )


def use_precision(options: OptimizeOptions) -> None:
    """The process-wide matmul setting a precision needs: TF32 tensor cores for `tf32`.

    The engine process serves one precision, so a global setting is its own; inductor
    reads it when it compiles and cuBLAS at each call. Other precisions leave PyTorch's
    default ("highest": true fp32 matmuls) as it is.
    """
    if options.precision == "tf32":
        torch.set_float32_matmul_precision("high")


def use_compile_cache(folder: Path) -> None:
    """Keep inductor's and Triton's caches (FX graphs, kernels, autotuning) in `folder`.

    Both read these variables when they first compile, which happens after this, on the
    worker thread; a restart with the same folder skips code generation and autotuning.
    """
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    # FX-graph and local autotune caches are on by default; a variable, not inductor's
    # config, while inductor is not imported: importing it here cost a warm AOT start
    # seconds on the GPU machine, and loading a package does not need all of it
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    if "torch._inductor.config" in sys.modules:
        torch._inductor.config.fx_graph_cache = True


def compile_cache_hits(since: dict[str, int] | None = None) -> dict[str, int]:
    """Inductor's FX-graph cache hits and misses in this process (since a snapshot).

    The counters are process-wide: an engine reports the difference over its own warm-up.
    """
    if "torch._dynamo" not in sys.modules:  # nothing compiled; importing it costs seconds
        return {"hit": 0, "miss": 0}
    counters = torch._dynamo.utils.counters["inductor"]
    now = {"hit": int(counters["fxgraph_cache_hit"]), "miss": int(counters["fxgraph_cache_miss"])}
    base = since or {}
    return {event: count - base.get(event, 0) for event, count in now.items()}


# What a device library says when it has no kernel for a quantized or sparse product
# (cuBLASLt's int8 layouts, cuSPARSELt on a GPU without it, fp8 before Hopper).
_REFUSALS = ("NOT_SUPPORTED", "not supported", "CUSPARSE", "cuSPARSELt", "_scaled_mm",
             "Float8", "no kernel image")  # fmt: skip


class VariantUnsupportedError(RuntimeError):
    """A quantized or sparse variant this device cannot run: start-up stops here, with the
    setting to change, rather than a library's error at the first request."""


def variant_refusal(
    settings: Settings, device: torch.device, step: str, exc: BaseException
) -> VariantUnsupportedError | None:
    """The start-up error for `exc`, raised by the start-up `step`, when a quantized or
    sparse variant is the likely cause (None otherwise: the error stands as it is)."""
    variant = {"quantization": settings.quantization, "sparsity": settings.sparsity,
               "swin_quantization": settings.swin_quantization}  # fmt: skip
    chosen = [f"SERVE_{name.upper()}={value}" for name, value in variant.items()
              if value not in ("none", "same")]  # fmt: skip
    message = str(exc)
    if not chosen or not any(marker in message for marker in _REFUSALS):
        return None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    first = message.strip().splitlines()[0][:300] if message.strip() else type(exc).__name__
    return VariantUnsupportedError(
        f"{' and '.join(chosen)} cannot run on this device ({where}): {step} failed with "
        f"{first}. Start with SERVE_QUANTIZATION=none, SERVE_SWIN_QUANTIZATION=same and "
        "SERVE_SPARSITY=none (the default, "
        "bf16 on a GPU) or another variant; docs/BENCHMARKS.md lists what each GPU was "
        "measured to run."
    )
