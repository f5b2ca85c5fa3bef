"""Weight-and-activation quantization and 2:4 sparsity for `nn.Linear`, in core torch.

Small module swaps applied once at load time, like gpt-fast's quantizers:

- `Int8DynamicLinear`: int8 weights (one scale per output channel) and int8 activations
  quantized per token at run time. On CUDA with Triton the product is our kernel with the
  dequantisation, bias and GELU fused into its epilogue (`models.int8_gemm`, bf16 out);
  `kernel="int_mm"` keeps the earlier `torch._int_mm` (int32 out) then separate kernels,
  for comparison. On the CPU both run the same arithmetic in torch.
- `Fp8RowwiseLinear`: float8 e4m3 weights and activations with one scale per row, through
  `torch._scaled_mm` (Hopper's fp8 tensor cores; bf16 output).
- `semi_structured_2to4`: prunes a weight to 2 non-zeros in every 4 along the input axis
  (magnitude), and on CUDA stores it in cuSPARSELt's compressed form.

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
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.int8_gemm import int8_linear, quantize_rows
from models.int8_gptq import gptq_int8

__all__ = [
    "INT8_MAX_ERROR",
    "INT8_MAX_KEPT",
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
    "quantize_linears",
    "quantize_linears_torchao",
    "semi_structured_2to4",
    "torchao_unsupported",
]

Quantization = Literal["none", "int8", "fp8"]
# "fused": models.int8_gemm (Triton on CUDA); "int_mm": torch._int_mm, then the epilogue
Int8Kernel = Literal["fused", "int_mm"]
# core: our layers (int8: the fused kernel and the per-layer choice); int_mm: our layers
# through torch._int_mm, every layer (the earlier int8, for comparison); torchao: quantize_
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


class Int8DynamicLinear(nn.Module):
    """`y = x W^T + b` (then GELU where `gelu`) with int8 W (per output channel) and int8 x
    (per token)."""

    # buffers, typed for the checker (register_buffer makes them attributes)
    weight_int8: Tensor
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
        if hessian is not None:  # GPTQ rounding (models.int8_gptq): the same scales
            q, scale = gptq_int8(weight, hessian)
        else:
            scale = weight.abs().amax(dim=1).clamp(min=_EPS) / 127.0  # [N]
            q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # [N, K] contiguous: K-major, what int8 tensor cores take (its .t() is col-major)
        self.register_buffer("weight_int8", q.contiguous())
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
                f"kernel={self.kernel}, gelu={self.gelu}")  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        xq, x_scale = quantize_rows(x.reshape(-1, shape[-1]))  # [M, K] int8, [M]
        if self.kernel == "fused":
            y = int8_linear(xq, x_scale, self.weight_int8, self.weight_scale, self.bias, None,
                            self.gelu, self.out_dtype)  # fmt: skip
            return y.reshape(*shape[:-1], self.out_features)
        acc = int8_mm(xq, self.weight_int8.t())  # [M, N] int32
        y = acc.float() * x_scale[:, None] * self.weight_scale
        if self.bias is not None:
            y = y + self.bias.float()
        if self.gelu:
            y = F.gelu(y)
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)


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


def quantize_linears(
    module: nn.Module,
    kind: Quantization,
    include: Callable[[str, nn.Linear], bool],
    *,
    backend: QuantBackend = "core",
    calibrate: Callable[[nn.Module], object] | None = None,
    max_kept: float = INT8_MAX_KEPT,
) -> list[str]:
    """Swap every `nn.Linear` that `include(name, layer)` accepts; returns the names swapped.

    Shapes that the int8/fp8 kernels cannot take (dimensions not multiples of 16) stay as
    they are. int8 with the `core` backend: the fused kernel, and when `calibrate` is given
    (it runs `module` on sample inputs), the layers whose measured int8 error is worst stay
    in float (at most `max_kept` of them; `models.int8_select`), the others' weights are
    rounded by GPTQ and their biases corrected for it (`Int8DynamicLinear(input_mean=...,
    hessian=...)`); `int_mm`: `torch._int_mm`, every accepted layer, rounded to nearest
    (the earlier path, for comparison). With int8, an MLP's GELU moves into its first
    product (`fuse_gelu`).
    """
    if kind == "none":
        return []

    def quantizable(name: str, layer: nn.Linear) -> bool:
        return _quantizable(name, layer, include)

    accepted: Callable[[str, nn.Linear], bool] = quantizable
    means: dict[str, Tensor] = {}
    hessians: dict[str, Tensor] = {}
    if kind == "int8" and backend == "core" and calibrate is not None:
        from models.int8_select import int8_include

        accepted, choice = int8_include(
            module, lambda: calibrate(module), quantizable,
            max_error=INT8_MAX_ERROR, max_kept=max_kept, hessians=True,
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
            new = (
                Int8DynamicLinear(layer, kernel=kernel, input_mean=mean, hessian=hessian)
                if kind == "int8"
                else Fp8RowwiseLinear(layer)
            )
            setattr(child, attr, new)
            swapped.append(full)
    if kind == "int8":
        fuse_gelu(module)
    return swapped


def fuse_gelu(module: nn.Module) -> list[str]:
    """Move exact GELU into the int8 product before it, where the structure is known.

    Swin's `Mlp` is `fc2(act(fc1(x)))` and SAM's `MLPBlock` `lin2(act(lin1(x)))`: when the
    first Linear is an `Int8DynamicLinear` and `act` is `nn.GELU()` (erf), the layer
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
        if isinstance(layer, Int8DynamicLinear) and not layer.gelu:
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


def prune_2to4(weight: Tensor) -> Tensor:
    """Keep the 2 largest-magnitude values of every 4 consecutive inputs; zero the rest."""
    out_features, in_features = weight.shape
    if in_features % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, got {in_features}")
    groups = weight.reshape(out_features, in_features // 4, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(out_features, in_features)


@torch.library.custom_op("samserve::sparse24_linear", mutates_args=())
def sparse24_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """`x [M, K] @ W^T + b` with W 2:4-sparse and compressed by cuSPARSELt (`packed`).

    An opaque op for torch.compile: the compressed weight is a plain tensor here, which
    dynamo can trace, where torch's own sparse tensor subclass cannot be (torch 2.11).
    """
    m = x.shape[0]
    pad = -m % 16  # cuSPARSELt wants the dense operand's dimensions in multiples of 16
    dense = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = torch._cslt_sparse_mm(packed, dense.t(), bias=bias, transpose_result=True)
    return out[:m] if pad else out


@sparse24_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


class Sparse24Linear(nn.Module):
    """A Linear whose 2:4-pruned weight lives in cuSPARSELt's compressed form (CUDA only)."""

    packed: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        pruned = prune_2to4(linear.weight.detach())
        self.register_buffer("packed", torch._cslt_compress(pruned))
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = sparse24_linear(x.reshape(-1, shape[-1]), self.packed, self.bias, self.out_features)
        return y.reshape(*shape[:-1], self.out_features)


def semi_structured_2to4(
    module: nn.Module, include: Callable[[str, nn.Linear], bool], *, compress: bool
) -> list[str]:
    """Prune the accepted Linear layers to 2:4; with `compress`, store them for cuSPARSELt.

    Compression needs CUDA (fp16/bf16 weights); without it the pruned weights stay dense,
    which gives the same numbers (used by the CPU tests and as the fidelity reference).
    """
    done = []
    for name, child in list(module.named_modules()):
        for attr, layer in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if not isinstance(layer, nn.Linear) or not include(full, layer):
                continue
            if compress:
                setattr(child, attr, Sparse24Linear(layer))
            else:
                layer.weight = nn.Parameter(prune_2to4(layer.weight.detach()), requires_grad=False)
            done.append(full)
    return done


def linear_reference(layer: nn.Module, x: Tensor) -> Tensor:
    """The float result a quantized layer approximates (for fidelity checks)."""
    gelu = False
    if isinstance(layer, Int8DynamicLinear):
        w = layer.weight_int8.float() * layer.weight_scale[:, None]
        gelu = layer.gelu
    elif isinstance(layer, Fp8RowwiseLinear):
        w = layer.weight_fp8.float() * layer.weight_scale.t()
    else:
        raise TypeError(f"not a quantized layer: {type(layer).__name__}")
    bias = None if layer.bias is None else layer.bias.float()
    y = F.linear(x.float(), w, bias)
    return F.gelu(y) if gelu else y
