"""Weight-and-activation quantization for `nn.Linear`, in core torch: the load-time swaps.
The layers live in models/quant_linear.py and 2:4 sparsity in models/sparsity.py (both
re-exported here).

Small module swaps applied once at load time, like gpt-fast's quantizers:

- `Int8DynamicLinear` / `Fp8DynamicLinear` (`DynamicQuantLinear`): int8 or float8 e4m3
  weights (one scale per output channel) and activations quantized per token at run time.
  On CUDA with Triton the product is our kernel with the dequantisation, bias and GELU fused
  into its epilogue (`models.int8_gemm`, `models.fp8_gemm`; bf16 out); the input may come
  already quantised from the LayerNorm before (`models.ln_quant`). int8's
  `kernel="int_mm"` keeps the earlier `torch._int_mm` (int32 out) then separate kernels,
  for comparison. On the CPU every form runs the same arithmetic in torch.
- `Fp8RowwiseLinear`: the earlier fp8, through `torch._scaled_mm` (bias in it, no GELU),
  for comparison (`backend="int_mm"`): on an H100 it ran Swin-T 6% slower than bf16.

Under `torch.compile` the per-token quantization fuses into the kernel that produced the
activation, so what remains is the low-precision matrix product. Whether that beats bf16
depends on the shapes and the chip: measure (bench/sam_encoder.py) before choosing.
torchao offers the same transforms, and `quantize_linears_torchao` uses it where it is
installed and asked for (`SERVE_QUANTIZATION_BACKEND=torchao`). These few lines stay the
default: they were measured on the H100 (docs/BENCHMARKS.md), they need no dependency
pinned to one torch release, and every one of them runs on the CPU for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.int8_gemm import triton_gemm_available
from models.quant_linear import (
    DynamicQuantLinear,
    Fp8DynamicLinear,
    Fp8RowwiseLinear,
    Int8DynamicLinear,
    Int8Kernel,
    int8_mm,
    linear_reference,
)
from models.sparsity import Sparse24Linear, prune_2to4, semi_structured_2to4

__all__ = [
    "FP8_MAX_ERROR",
    "INT8_MAX_ERROR",
    "INT8_MAX_KEPT",
    "DynamicQuantLinear",
    "Fp8DynamicLinear",
    "Fp8RowwiseLinear",
    "GeluLinear",
    "Int8DynamicLinear",
    "Int8Kernel",
    "QuantBackend",
    "Quantization",
    "Sparse24Linear",
    "fuse_gelu",
    "gelu_epilogue",
    "int8_mm",
    "linear_reference",
    "prune_2to4",
    "quantization_unsupported",
    "quantize_linears",
    "quantize_linears_torchao",
    "semi_structured_2to4",
    "torchao_unsupported",
]

Quantization = Literal["none", "int8", "fp8"]
# core: our layers (the fused kernels and the per-layer choice); int_mm: the earlier torch
# paths, every layer (int8 through torch._int_mm, fp8 through torch._scaled_mm), for
# comparison; torchao: quantize_
QuantBackend = Literal["core", "int_mm", "torchao"]


def _quantizable(name: str, layer: nn.Module, include: Callable[[str, nn.Linear], bool]) -> bool:
    """An accepted Linear whose dimensions the int8/fp8 kernels take (multiples of 16); not
    a `GeluLinear`, whose GELU a quantised layer would drop (the epilogue is applied after
    quantisation, to the layers left in float)."""
    return (
        isinstance(layer, nn.Linear)
        and not isinstance(layer, GeluLinear)
        and include(name, layer)
        and not (layer.in_features % 16 or layer.out_features % 16)
    )


# The per-layer choice (models.int8_select): a layer stays in float when its int8 output is
# off by more than this (relative, on sample images), for at most this fraction of layers.
# Random Swin-T weights on the real photos: fc2 (after GELU) 0.012-0.015, the rest
# 0.009-0.011 (the same order on `smooth_images`, Spearman 0.97).
INT8_MAX_ERROR = 0.0125
INT8_MAX_KEPT = 0.125
# fp8 e4m3 (3 mantissa bits) errs 3.5x int8 and on every layer alike (its rounding is
# relative to each value, not to the row's largest): random Swin-T on 8 `smooth_images`,
# 0.0356-0.0385 (median 0.0370, fc2 not worse) against int8's 0.0088-0.0153. Past the
# median plus a little: the per-layer choice keeps its usual share (INT8_MAX_KEPT).
FP8_MAX_ERROR = 0.0375


def quantization_unsupported(
    kind: Quantization, backend: QuantBackend, device: torch.device
) -> str | None:
    """Why `kind` cannot run on `device` with `backend` (core, int_mm), or None when it can:
    what the engine says at start (naming SERVE_QUANTIZATION), not a CUBLAS or Triton error
    at the first request. The CPU runs every form (torch references)."""
    if kind == "none" or device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    # "not supported": server.engine.build's variant_refusal adds what to start with instead
    if kind == "fp8" and cap < (8, 9):
        return (f"SERVE_QUANTIZATION=fp8 is not supported on compute capability "
                f"{cap[0]}.{cap[1]}: fp8 tensor cores need 8.9 or more (Ada, Hopper)")  # fmt: skip
    if kind == "int8" and cap < (8, 0):
        return (f"SERVE_QUANTIZATION=int8 is not supported on compute capability "
                f"{cap[0]}.{cap[1]}: int8 tensor cores need 8.0 or more")  # fmt: skip
    if backend == "core" and not triton_gemm_available():
        return f"SERVE_QUANTIZATION={kind} is not supported here: its CUDA kernel needs Triton"
    return None


def quantize_linears(
    module: nn.Module,
    kind: Quantization,
    include: Callable[[str, nn.Linear], bool],
    *,
    backend: QuantBackend = "core",
    calibrate: Callable[[nn.Module], object] | None = None,
    max_kept: float | None = None,
    norm_quant: bool = False,
    mlp_hop: bool = False,
    mlp_static: bool = False,
    proj_static: bool = False,
) -> list[str]:
    """Swap every `nn.Linear` that `include(name, layer)` accepts; returns the names swapped.

    Shapes that the int8/fp8 kernels cannot take (dimensions not multiples of 16) stay as
    they are. The `core` backend: the fused kernel (int8 or fp8), and when `calibrate` is
    given (it runs `module` on sample inputs), the layers whose measured error is worst stay
    in float (at most `max_kept` of them, None: `INT8_MAX_KEPT` as it is at the call, so a
    bench can change it; `models.int8_select`), the others' biases are corrected for their
    weights' rounding, which for int8 is GPTQ's
    (`Int8DynamicLinear(input_mean=..., hessian=...)`); `int_mm`: the earlier torch paths
    (`torch._int_mm`, `torch._scaled_mm`), every accepted layer, rounded to nearest, for
    comparison. With the fused kernel an MLP's GELU moves into its first product
    (`fuse_gelu`), and with `norm_quant` the LayerNorm before qkv and the MLP quantises
    their input (`models.ln_quant.fuse_norm_quant`), with `mlp_hop` the MLP's first Linear
    hands its output quantised to the second (`models.mlp_hop`), with `mlp_static` (int8,
    `calibrate` needed) the second takes its input by fixed per-channel scales, measured on
    `calibrate`'s inputs and folded into its weight, and the first writes it so
    (`models.mlp_static`); with `proj_static` (the same needs) SAM's attention output
    projections alike, their attention kernels writing it (`attention_projections`). Refuses
    (NotImplementedError) a kind the module's device cannot run
    (`quantization_unsupported`).
    """
    if kind == "none":
        return []
    param = next(module.parameters(), None)
    why_not = quantization_unsupported(
        kind, backend, param.device if param is not None else torch.device("cpu")
    )
    if why_not is not None and backend != "torchao":
        # a RuntimeError: the engine's start-up turns it into its VariantUnsupportedError
        raise NotImplementedError(why_not)

    def quantizable(name: str, layer: nn.Linear) -> bool:
        return _quantizable(name, layer, include)

    accepted: Callable[[str, nn.Linear], bool] = quantizable
    means: dict[str, Tensor] = {}
    hessians: dict[str, Tensor] = {}
    scales: dict[str, Tensor] = {}
    if mlp_static and (kind != "int8" or backend != "core" or calibrate is None or mlp_hop):
        raise ValueError("mlp_static: int8 on the core backend, with calibrate, without mlp_hop")
    if proj_static and (kind != "int8" or backend != "core" or calibrate is None):
        raise ValueError("proj_static: int8 on the core backend, with calibrate")
    if backend == "core" and calibrate is not None:
        from models.int8_select import int8_include
        from models.mlp_hop import mlp_second_layers
        from models.mlp_static import HEADROOM, input_amax, static_scale

        amax: dict[str, Tensor] = {}
        projections = attention_projections(module) if proj_static else []
        fixed = [*(mlp_second_layers(module) if mlp_static else ()), *projections]
        if fixed:  # one more pass: the scales before the errors they cause
            layers = dict(module.named_modules())
            fixed = [n for n in fixed if quantizable(n, layers[n])]
            amax = input_amax(module, lambda: calibrate(module), fixed)
            if PROJ_HEADROOM is not None:  # the projections' own, as if their peaks moved
                for name in set(projections) & set(amax):
                    amax[name] = amax[name] * (PROJ_HEADROOM / HEADROOM)
            scales = {name: static_scale(peak) for name, peak in amax.items()}
        accepted, choice = int8_include(
            module, lambda: calibrate(module), quantizable,
            max_error=INT8_MAX_ERROR if kind == "int8" else FP8_MAX_ERROR,
            max_kept=INT8_MAX_KEPT if max_kept is None else max_kept,
            hessians=kind == "int8", kind=kind,
            grouped=mlp_second_layers(module) if mlp_hop else frozenset(), static=amax,
        )  # fmt: skip
        means, hessians = choice.input_means, choice.hessians
    kernel: Int8Kernel = "int_mm" if backend == "int_mm" else "fused"
    swapped = []
    for name, child in list(module.named_modules()):
        for attr, layer in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if not isinstance(layer, nn.Linear) or not accepted(full, layer):
                continue
            mean, hessian = means.get(full), hessians.pop(full, None)
            new: nn.Module
            if kind == "int8":
                new = Int8DynamicLinear(layer, kernel=kernel, input_mean=mean, hessian=hessian,
                                        input_scale=scales.get(full))  # fmt: skip
            elif backend == "int_mm":
                new = Fp8RowwiseLinear(layer)
            else:
                new = Fp8DynamicLinear(layer, input_mean=mean)
            setattr(child, attr, new)
            swapped.append(full)
    fuse_gelu(module)
    if norm_quant:
        from models.ln_quant import fuse_norm_quant

        fuse_norm_quant(module)
    if mlp_hop:
        from models.mlp_hop import fuse_mlp_hop

        fuse_mlp_hop(module)
    if mlp_static:
        from models.mlp_static import fuse_mlp_static

        fuse_mlp_static(module)
    return swapped


# Which blocks' projections `proj_static` takes, read at the call (a bench measures each):
# "all", "windowed" or "global"; and their scales' headroom over the calibration's peaks
# (None: `models.mlp_static.HEADROOM`, lin2's 1.5). 3: on the photos the global blocks'
# proj inputs pass 1.5x the 8 smooth images' peaks in 8-20% of their channels (up to
# 5.4x), and saturate. Random ViT-B on the 7 photos (CPU, bench/sam_static_calibration.py,
# docs/BENCHMARKS.md, issue 20): mask IoU 0.9835 / min 0.9432 at 1.5x, 0.9914 / 0.9727 at
# 3x, 0.9897 / 0.9665 at 6x (steps too coarse); without proj_static 0.9932 / 0.9727.
PROJ_STATIC_BLOCKS = "all"
PROJ_HEADROOM: float | None = 3.0


def attention_projections(module: nn.Module) -> list[str]:
    """The output projections of SAM's image-encoder attention (`attn.proj` of each
    `models.sam.image_encoder.Block` of the kind `PROJ_STATIC_BLOCKS` names): their
    attention kernels can write the input int8 by fixed scales (`proj_static`), as lin1
    writes lin2's."""
    from models.sam.image_encoder import Block

    wanted = {"all": (True, False), "windowed": (True,), "global": (False,)}[PROJ_STATIC_BLOCKS]
    return [f"{name}.attn.proj" if name else "attn.proj"
            for name, child in module.named_modules()
            if isinstance(child, Block) and (child.window > 0) in wanted]  # fmt: skip


def _exact_gelu_mlps(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(full name of the first layer, the MLP, its attribute, the layer) for each of Swin's
    `Mlp` (`fc2(act(fc1(x)))`) and SAM's `MLPBlock` (`lin2(act(lin1(x)))`) whose `act` is
    still the exact `nn.GELU()`: where GELU may move into the first product."""
    from models.sam.common import MLPBlock
    from models.swin.model import Mlp

    first_of = {Mlp: "fc1", MLPBlock: "lin1"}
    for name, child in list(module.named_modules()):
        attr = first_of.get(type(child))
        act = getattr(child, "act", None)
        if attr is None or type(act) is not nn.GELU or act.approximate != "none":
            continue
        yield (f"{name}.{attr}" if name else attr), child, attr, getattr(child, attr)


def fuse_gelu(module: nn.Module) -> list[str]:
    """Move exact GELU into the int8/fp8 product before it, where the structure is known.

    When an MLP's first Linear is a `DynamicQuantLinear` and its `act` the exact GELU, the
    layer applies GELU in its epilogue and `act` becomes `nn.Identity()`: one pass over the
    hidden activation (4x the block's width) fewer. Returns the fused layers' names.
    """
    fused = []
    for full, mlp, _, layer in _exact_gelu_mlps(module):
        if isinstance(layer, DynamicQuantLinear) and not layer.gelu:
            layer.gelu = True
            mlp.act = nn.Identity()
            fused.append(full)
    return fused


class GeluLinear(nn.Linear):
    """`gelu(linear(x))` (tanh form) in one cuBLASLt call on CUDA: GELU in the GEMM's epilogue.

    Why: compiled, the bf16 MLP is a cuBLAS GEMM and then a Triton kernel that reads and
    writes the hidden activation (4x the block's width) once more only for GELU: 1.8 of
    the 20.7 ms of a SAM encoder batch of 8 on an H100 (docs/BENCHMARKS.md, issue 20).
    `torch._addmm_activation` with `use_gelu` asks cuBLASLt for its GELU_BIAS epilogue,
    and inductor keeps it as one extern call. cuBLASLt's GELU is the tanh approximation,
    not the erf of the models' `nn.GELU()` (at most 4.7e-4 apart: bf16 rounds values of
    0.125 and more by up to as much); the CPU path computes the same tanh form, so both
    devices serve one function.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.bias is not None:
            flat = x.reshape(-1, x.shape[-1])
            out = torch._addmm_activation(self.bias, flat, self.weight.t(), use_gelu=True)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")


def gelu_epilogue(module: nn.Module) -> list[str]:
    """Swap each float MLP's first Linear and its exact GELU for a `GeluLinear`, in place.

    The same MLPs as `fuse_gelu`, when the first layer is still a plain `nn.Linear` with a
    bias (quantised layers fuse the exact GELU themselves). Returns the swapped names.
    """
    fused = []
    for full, mlp, attr, layer in _exact_gelu_mlps(module):
        if type(layer) is not nn.Linear or layer.bias is None:
            continue
        swapped = GeluLinear(layer.in_features, layer.out_features, device="meta")
        swapped.weight, swapped.bias = layer.weight, layer.bias
        setattr(mlp, attr, swapped)
        mlp.act = nn.Identity()
        fused.append(full)
    return fused


def torchao_unsupported(kind: Quantization, device: torch.device) -> str | None:
    """Why torchao cannot quantize `kind` on `device` here, or None when it can.

    torchao (an optional dependency) is PyTorch's library for these transforms; its fp8
    needs a GPU of compute capability 8.9 or more (Ada, Hopper), its int8 runs anywhere.
    """
    try:
        import torchao.quantization  # noqa: F401
    except Exception as exc:  # not installed, or built for another torch
        return f"torchao does not import ({type(exc).__name__}: {exc})"
    if kind == "fp8":
        if device.type != "cuda":
            return "torchao's fp8 needs CUDA"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "torchao's fp8 needs compute capability 8.9 or more"
    return None


def quantize_linears_torchao(
    module: nn.Module, kind: Quantization, include: Callable[[str, nn.Linear], bool]
) -> list[str]:
    """`quantize_linears` through torchao's `quantize_`: int8 dynamic activations with int8
    weights, or fp8 (e4m3) rowwise; the same layers are chosen (and the same odd shapes
    skipped). The weights become torchao tensor subclasses, which torch.compile traces."""
    if kind == "none":
        return []
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        quantize_,
    )

    config = (
        Int8DynamicActivationInt8WeightConfig()
        if kind == "int8"
        else Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    )
    chosen: list[str] = []

    def accept(layer: nn.Module, name: str) -> bool:
        ok = _quantizable(name, layer, include)
        if ok:
            chosen.append(name)
        return ok

    quantize_(module, config, filter_fn=accept)
    return chosen
