"""The quantized Linear layers `models.quantize` swaps in (moved out of it, which
re-exports them): weights quantized once per output channel, activations per token at run
time, to int8 or float8 e4m3.

- `DynamicQuantLinear` (`Int8DynamicLinear`, `Fp8DynamicLinear`): on CUDA with Triton the
  product is our kernel (`models.int8_gemm`, `models.fp8_gemm`) with the dequantisation,
  bias and GELU in its epilogue; its input may arrive already quantised, packed by the
  LayerNorm before (`models.ln_quant`) or as the MLP's hidden activation in groups
  (`models.mlp_hop`) or by fixed per-channel scales (`models.mlp_static`), and its output
  may leave in either form for the next Linear.
- `Fp8RowwiseLinear`: the earlier fp8 through `torch._scaled_mm`, for comparison.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.fp8_gemm import FP8, FP8_MAX, fp8_linear, quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import epilogue_reference, int8_linear, quantize_rows
from models.int8_gptq import gptq_int8
from models.ln_quant import packed_linear
from models.mlp_hop import linear_from_groups, linear_to_groups
from models.mlp_static import linear_from_static, linear_to_static, quantize_static

__all__ = [
    "DynamicQuantLinear",
    "Fp8DynamicLinear",
    "Fp8RowwiseLinear",
    "Int8DynamicLinear",
    "Int8Kernel",
    "int8_mm",
    "linear_reference",
    "linear_then_residual",
]

# "fused": models.int8_gemm (Triton on CUDA); "int_mm": torch._int_mm, then the epilogue
Int8Kernel = Literal["fused", "int_mm"]

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

    `input_scale [K]` (int8 only): the input is quantised by these fixed per-channel scales
    instead of per token, and they are folded into the weight's columns before it is
    quantised (`models.mlp_static`); `input_mean` and `hessian` are then the scaled
    input's. The input arrives int8 from the Linear before (`output_inv_scale`, set by
    `fuse_mlp_static`) or in float, quantised here.
    """

    kind: ClassVar[Literal["int8", "fp8"]] = "int8"
    # forward(x, residual=...) adds the residual in the epilogue (Swin's / SAM's MLP ask)
    fuses_residual: ClassVar[bool] = True
    # buffers, typed for the checker (register_buffer makes them attributes)
    weight_q: Tensor
    weight_scale: Tensor
    bias: Tensor | None
    input_inv_scale: Tensor | None
    output_inv_scale: Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        *,
        kernel: Int8Kernel = "fused",
        gelu: bool = False,
        input_mean: Tensor | None = None,
        hessian: Tensor | None = None,
        input_scale: Tensor | None = None,
    ) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        if input_scale is not None:
            if self.kind != "int8" or kernel != "fused":
                raise ValueError("fixed input scales: int8 and the fused kernel only")
            weight = weight * input_scale.float().to(weight.device)[None, :]  # x W^T = (x/s)(Ws)^T
        self.register_buffer(
            "input_inv_scale", None if input_scale is None else 1.0 / input_scale.float()
        )
        # set by models.mlp_static.fuse_mlp_static: the output leaves int8 by these
        self.register_buffer("output_inv_scale", None)
        if self.kind == "fp8":
            if kernel != "fused" or hessian is not None:
                raise ValueError("fp8: the fused kernel, weights rounded to nearest only")
            q, scale = quantize_weight_fp8(weight)
        elif hessian is not None:  # GPTQ rounding (models.int8_gptq): the same scales
            q, scale = gptq_int8(weight, hessian)
        else:
            q, scale = quantize_rows(weight)  # per output channel, as activations per token
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
        self.hop_out = False  # the output quantised for the next Linear (models.mlp_hop)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kind={self.kind}, kernel={self.kernel}, gelu={self.gelu}, "
                f"hop_out={self.hop_out}, static_in={self.input_inv_scale is not None}, "
                f"static_out={self.output_inv_scale is not None}")  # fmt: skip

    def forward(
        self, x: Tensor | tuple[Tensor, Tensor], residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`x`: a float activation `[..., K]`; packed rows `[..., K + 16]` int8 from a
        `QuantizingLayerNorm`; or the MLP's hidden activation from the first Linear, as
        (values, scales per 128 columns). The types are static: each traces to one path.
        `residual` `[..., N]` is added to the output in the epilogue."""
        n = self.out_features
        res = residual.reshape(-1, n) if residual is not None else None
        if self.input_inv_scale is not None:  # models.mlp_static: fixed input scales
            if isinstance(x, tuple):
                raise TypeError("a fixed-scale layer takes its input int8 or float, not groups")
            if x.shape[-1] != self.in_features:  # packed norm rows are not this input
                raise ValueError(f"a fixed-scale layer takes [..., {self.in_features}], "
                                 f"got {tuple(x.shape)}")  # fmt: skip
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features)
            q = flat if flat.dtype == torch.int8 else quantize_static(flat, self.input_inv_scale)
            y = linear_from_static(q, self.weight_q, self.weight_scale, self.bias, res,
                                   self.out_dtype)  # fmt: skip
            return y.reshape(*lead, n)
        if isinstance(x, tuple):  # models.mlp_hop
            q, scales = x
            lead = q.shape[:-1]
            y = linear_from_groups(q.reshape(-1, self.in_features),
                                   scales.reshape(-1, scales.shape[-1]), self.weight_q,
                                   self.weight_scale, self.bias, res, self.out_dtype)  # fmt: skip
            return y.reshape(*lead, n)
        lead = x.shape[:-1]
        packed = x.dtype == torch.int8  # by a QuantizingLayerNorm (models.ln_quant)
        if packed:
            xq, x_scale = x.reshape(-1, x.shape[-1]), None  # K + ln_quant.PACK_PAD bytes
        elif self.kind == "fp8":
            xq, x_scale = quantize_rows_fp8(x.reshape(-1, self.in_features))
        else:
            xq, x_scale = quantize_rows(x.reshape(-1, self.in_features))  # [M, K] int8, [M]
        if self.output_inv_scale is not None:  # models.mlp_static: int8 by fixed scales
            if residual is not None:
                raise ValueError("a quantised output takes no residual")
            q = linear_to_static(xq, x_scale, self.weight_q, self.weight_scale, self.bias,
                                 self.gelu, self.output_inv_scale)  # fmt: skip
            return q.reshape(*lead, n)
        if self.hop_out:  # models.mlp_hop: the output quantised per row and 128 columns
            if residual is not None:
                raise ValueError("a quantised output (hop_out) takes no residual")
            q, scales = linear_to_groups(xq, x_scale, self.weight_q, self.weight_scale,
                                         self.bias, self.gelu)  # fmt: skip
            return q.reshape(*lead, n), scales.reshape(*lead, scales.shape[-1])
        if x_scale is None:
            y = packed_linear(xq, self.weight_q, self.weight_scale, self.bias, res,
                              self.gelu, self.out_dtype)  # fmt: skip
        elif self.kind == "fp8":
            y = fp8_linear(xq, x_scale, self.weight_q, self.weight_scale, self.bias, res,
                           self.gelu, self.out_dtype)  # fmt: skip
        elif self.kernel == "fused":
            y = int8_linear(xq, x_scale, self.weight_q, self.weight_scale, self.bias, res,
                            self.gelu, self.out_dtype)  # fmt: skip
        else:
            acc = int8_mm(xq, self.weight_q.t())  # [M, N] int32
            y = epilogue_reference(acc.float(), x_scale, self.weight_scale, self.bias, res,
                                   self.gelu, self.out_dtype)  # fmt: skip
        return y.reshape(*lead, n)


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


def linear_then_residual(linear: nn.Module, x: Tensor, residual: Tensor | None) -> Tensor:
    """`linear(x) + residual`: the residual added in the layer's epilogue where the layer
    fuses it (`DynamicQuantLinear.fuses_residual`), after it otherwise. The MLPs of SAM's
    encoder and Swin end in it."""
    if residual is None:
        return linear(x)
    if getattr(linear, "fuses_residual", False):
        return linear(x, residual=residual)
    return residual + linear(x)


def linear_reference(layer: nn.Module, x: Tensor) -> Tensor:
    """The float result a quantized layer approximates (for fidelity checks)."""
    gelu = False
    if isinstance(layer, DynamicQuantLinear):
        w = layer.weight_q.float() * layer.weight_scale[:, None]
        gelu = layer.gelu
        if layer.input_inv_scale is not None:  # the scales folded into w's columns
            x = x.float() * layer.input_inv_scale
    elif isinstance(layer, Fp8RowwiseLinear):
        w = layer.weight_fp8.float() * layer.weight_scale.t()
    else:
        raise TypeError(f"not a quantized layer: {type(layer).__name__}")
    bias = None if layer.bias is None else layer.bias.float()
    y = F.linear(x.float(), w, bias)
    return F.gelu(y) if gelu else y
