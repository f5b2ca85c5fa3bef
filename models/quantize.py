"""Weight-and-activation quantization for `nn.Linear`, in core torch (2:4 sparsity, once
here, lives in models/sparsity.py and is re-exported).

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

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.fp8_gemm import fp8_linear, quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import int8_linear, quantize_rows, triton_gemm_available
from models.int8_gptq import gptq_int8
from models.ln_quant import PACK_PAD, packed_linear
from models.sparsity import Sparse24Linear, prune_2to4, semi_structured_2to4

__all__ = [
    "FP8_MAX_ERROR",
    "INT8_MAX_ERROR",
    "INT8_MAX_KEPT",
    "DynamicQuantLinear",
    "Fp8DynamicLinear",
    "Fp8RowwiseLinear",
    "Int8DynamicLinear",
    "Int8Kernel",
    "QuantBackend",
    "Quantization",
    "Sparse24Linear",
    "fuse_gelu",
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
# "fused": models.int8_gemm (Triton on CUDA); "int_mm": torch._int_mm, then the epilogue
Int8Kernel = Literal["fused", "int_mm"]
# core: our layers (the fused kernels and the per-layer choice); int_mm: the earlier torch
# paths, every layer (int8 through torch._int_mm, fp8 through torch._scaled_mm), for
# comparison; torchao: quantize_
QuantBackend = Literal["core", "int_mm", "torchao"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_EPS = 1e-12


@torch.library.custom_op("serve::int8_mm", mutates_args=())
def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """`torch._int_mm(a, b)` with `a` row-major, whatever layout it arrives in.

    cuBLASLt refuses an int8 product whose activation is column-major once it has 65,536
    rows or more and few columns (`CUBLAS_STATUS_NOT_SUPPORTED ... transpose_mat1 1
    transpose_mat2 1`, H100, `python -m bench.int8_probe`), and inductor lays a quantized
    activation out as the op before it did: Swin-T's first stage at batch 64 arrives
    column-major. As a custom op the call is opaque to the compiler, so the `contiguous`
    here runs as written (a no-op for a row-major input).
    """
    return torch._int_mm(a.contiguous(), b)


@int8_mm.register_fake
def _int8_mm_shape(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)


class DynamicQuantLinear(nn.Module):
    """`y = x W^T + b` (then GELU where `gelu`) with W quantized per output channel and x per
    token at run time, to int8 (`Int8DynamicLinear`) or float8 e4m3 (`Fp8DynamicLinear`).

    `x` is a float activation, or packed quantised rows from a `QuantizingLayerNorm`
    (int8 `[..., K + 16]`, models.ln_quant), taken as they are.
    """

    kind: ClassVar[Literal["int8", "fp8"]] = "int8"
    # buffers, typed for the checker (register_buffer makes them attributes)
    weight_q: Tensor
    weight_scale: Tensor
    bias: Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        *,
        kernel: Int8Kernel = "fused",
        gelu: bool = False,
        input_mean: Tensor | None = None,
        hessian: Tensor | None = None,
    ) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        if self.kind == "fp8":
            if kernel != "fused" or hessian is not None:
                raise ValueError("fp8: the fused kernel, weights rounded to nearest only")
            q, scale = quantize_weight_fp8(weight)
        elif hessian is not None:  # GPTQ rounding (models.int8_gptq): the same scales
            q, scale = gptq_int8(weight, hessian)
        else:
            scale = weight.abs().amax(dim=1).clamp(min=_EPS) / 127.0  # [N]
            q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # [N, K] contiguous: K-major, what int8/fp8 tensor cores take (its .t() is col-major)
        self.register_buffer("weight_q", q.contiguous())
        self.register_buffer("weight_scale", scale)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        if input_mean is not None:
            # Bias correction (Nagel et al., 2019): the weights' rounding shifts the output
            # for the mean input by mean (W_q - W)^T, every token alike (so it survives
            # Swin's pooling; models/int8_gptq.py); taken out of the bias, in fp32.
            rounded = q.double() * scale.double()[:, None] - weight.double()
            shift = input_mean.to(rounded) @ rounded.t()  # [N]
            base = bias.double() if bias is not None else torch.zeros_like(shift)
            bias = (base - shift).float()
        self.register_buffer("bias", bias)
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel: Int8Kernel = kernel
        self.gelu = gelu  # nn.GELU() (exact erf) fused after the bias; see fuse_gelu

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kind={self.kind}, kernel={self.kernel}, gelu={self.gelu}")  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        lead, n = shape[:-1], self.out_features
        if x.dtype == torch.int8:  # packed by a QuantizingLayerNorm (the dtype is static)
            packed = x.reshape(-1, self.in_features + PACK_PAD)
            y = packed_linear(packed, self.weight_q, self.weight_scale, self.bias, None,
                              self.gelu, self.out_dtype)  # fmt: skip
            return y.reshape(*lead, n)
        x2 = x.reshape(-1, shape[-1])
        if self.kind == "fp8":
            xq, x_scale = quantize_rows_fp8(x2)
            y = fp8_linear(xq, x_scale, self.weight_q, self.weight_scale, self.bias, None,
                           self.gelu, self.out_dtype)  # fmt: skip
            return y.reshape(*lead, n)
        xq, x_scale = quantize_rows(x2)  # [M, K] int8, [M]
        if self.kernel == "fused":
            y = int8_linear(xq, x_scale, self.weight_q, self.weight_scale, self.bias, None,
                            self.gelu, self.out_dtype)  # fmt: skip
            return y.reshape(*lead, n)
        acc = int8_mm(xq, self.weight_q.t())  # [M, N] int32
        y = acc.float() * x_scale[:, None] * self.weight_scale
        if self.bias is not None:
            y = y + self.bias.float()
        if self.gelu:
            y = F.gelu(y)
        return y.to(self.out_dtype).reshape(*lead, n)


class Int8DynamicLinear(DynamicQuantLinear):
    """int8 weights and activations (GPTQ rounding and bias correction as calibrated)."""

    kind: ClassVar[Literal["int8", "fp8"]] = "int8"


class Fp8DynamicLinear(DynamicQuantLinear):
    """float8 e4m3 weights and activations, through `models.fp8_gemm` (bias correction as
    calibrated; no GPTQ: its grid is int8's)."""

    kind: ClassVar[Literal["int8", "fp8"]] = "fp8"


class Fp8RowwiseLinear(nn.Module):
    """`y = x W^T + b` with float8 e4m3 W and x, one scale per row of each (bf16 output)."""

    weight_fp8: Tensor
    weight_scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / FP8_MAX  # [N, 1]
        self.register_buffer("weight_fp8", (weight / scale).to(FP8).contiguous())  # [N, K]
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N] fp32
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=_EPS) / FP8_MAX  # [M, 1]
        xq = (x2.float() / x_scale).to(FP8)
        y = torch._scaled_mm(
            xq,
            self.weight_fp8.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=torch.bfloat16,
        )
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)


def _quantizable(name: str, layer: nn.Module, include: Callable[[str, nn.Linear], bool]) -> bool:
    """An accepted Linear whose dimensions the int8/fp8 kernels take (multiples of 16)."""
    return (
        isinstance(layer, nn.Linear)
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
    max_kept: float = INT8_MAX_KEPT,
    norm_quant: bool = False,
) -> list[str]:
    """Swap every `nn.Linear` that `include(name, layer)` accepts; returns the names swapped.

    Shapes that the int8/fp8 kernels cannot take (dimensions not multiples of 16) stay as
    they are. The `core` backend: the fused kernel (int8 or fp8), and when `calibrate` is
    given (it runs `module` on sample inputs), the layers whose measured error is worst stay
    in float (at most `max_kept` of them; `models.int8_select`), the others' biases are
    corrected for their weights' rounding, which for int8 is GPTQ's
    (`Int8DynamicLinear(input_mean=..., hessian=...)`); `int_mm`: the earlier torch paths
    (`torch._int_mm`, `torch._scaled_mm`), every accepted layer, rounded to nearest, for
    comparison. With the fused kernel an MLP's GELU moves into its first product
    (`fuse_gelu`), and with `norm_quant` the LayerNorm before qkv and the MLP quantises
    their input (`models.ln_quant.fuse_norm_quant`). Refuses (ValueError) a kind the
    module's device cannot run (`quantization_unsupported`).
    """
    if kind == "none":
        return []
    param = next(module.parameters(), None)
    why_not = quantization_unsupported(
        kind, backend, param.device if param is not None else torch.device("cpu")
    )
    if why_not is not None and backend != "torchao":
        raise ValueError(why_not)

    def quantizable(name: str, layer: nn.Linear) -> bool:
        return _quantizable(name, layer, include)

    accepted: Callable[[str, nn.Linear], bool] = quantizable
    means: dict[str, Tensor] = {}
    hessians: dict[str, Tensor] = {}
    if backend == "core" and calibrate is not None:
        from models.int8_select import int8_include

        accepted, choice = int8_include(
            module, lambda: calibrate(module), quantizable,
            max_error=INT8_MAX_ERROR if kind == "int8" else FP8_MAX_ERROR,
            max_kept=max_kept, hessians=kind == "int8", kind=kind,
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
                new = Int8DynamicLinear(layer, kernel=kernel, input_mean=mean, hessian=hessian)
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
    return swapped


def fuse_gelu(module: nn.Module) -> list[str]:
    """Move exact GELU into the int8/fp8 product before it, where the structure is known.

    Swin's `Mlp` is `fc2(act(fc1(x)))` and SAM's `MLPBlock` `lin2(act(lin1(x)))`: when the
    first Linear is a `DynamicQuantLinear` and `act` is `nn.GELU()` (erf), the layer
    applies GELU in its epilogue and `act` becomes `nn.Identity()`: one pass over the
    hidden activation (4x the block's width) fewer. Returns the fused layers' names.
    """
    from models.sam.common import MLPBlock
    from models.swin.model import Mlp

    first_of = {Mlp: "fc1", MLPBlock: "lin1"}
    fused = []
    for name, child in module.named_modules():
        attr = first_of.get(type(child))
        act = getattr(child, "act", None)
        if attr is None or type(act) is not nn.GELU or act.approximate != "none":
            continue
        layer = getattr(child, attr)
        if isinstance(layer, DynamicQuantLinear) and not layer.gelu:
            layer.gelu = True
            child.act = nn.Identity()
            fused.append(f"{name}.{attr}" if name else attr)
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


def linear_reference(layer: nn.Module, x: Tensor) -> Tensor:
    """The float result a quantized layer approximates (for fidelity checks)."""
    gelu = False
    if isinstance(layer, DynamicQuantLinear):
        w = layer.weight_q.float() * layer.weight_scale[:, None]
        gelu = layer.gelu
    elif isinstance(layer, Fp8RowwiseLinear):
        w = layer.weight_fp8.float() * layer.weight_scale.t()
    else:
        raise TypeError(f"not a quantized layer: {type(layer).__name__}")
    bias = None if layer.bias is None else layer.bias.float()
    y = F.linear(x.float(), w, bias)
    return F.gelu(y) if gelu else y
