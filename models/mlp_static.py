"""The MLP's hidden activation handed from its first Linear to its second in int8 by fixed
per-channel scales, calibrated at load time (issue 20).

Why: a per-token scale needs the row's largest value, and lin1's 3,072-wide row spans
several output tiles, none of which sees it whole. So per-token int8 writes lin1's output
in bf16 and quantises it in a pass of its own before lin2 (SAM ViT-B at batch 8 on an H200:
that MLP took 0.650 ms, bf16's 0.635). `models.mlp_hop` quantises per 128 columns instead,
but lin2 must then rescale each group's partial sums (0.633 ms). With one fixed scale per
hidden channel, measured in advance on sample images, lin1's epilogue writes int8 directly
(`launch_persistent_static_out`), and the scales fold into lin2's weight columns
(SmoothQuant's way: `x W^T = (x / s)(W s)^T`), so lin2 is a plain int8 product with one
scale per output channel: 0.456 ms (docs/BENCHMARKS.md, issue 20, fifteenth session).

The cost: values past the calibration's largest (times `HEADROOM`) saturate at +-127, and
a channel's scale is set by its largest value on any token. The service calibrates on 8
synthetic `smooth_images`; on SAM ViT-B (random weights, the photos, a CPU measurement)
that with `HEADROOM` 1.5 kept the masks as per-token scales do (IoU 0.9932 against 0.9931),
and scales from photos like the served ones did better (0.9958-0.9962). Trained
checkpoints have outlier channels random weights lack; a channel scale absorbs its own
outlier, and the folded weight column carries it (SmoothQuant's migration at strength 1).

Paths: `serve::linear_to_static` (lin1: int8 out) and `serve::linear_from_static` (lin2:
a folded int8 input), the persistent kernel on Hopper, the tile-per-program kernel on other
GPUs (lin1's output then quantised by torch), the torch reference on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from models.gemm_persistent import (
    launch_persistent,
    launch_persistent_static_out,
    persistent_for,
    served_config,
)
from models.int8_gemm import fused_supported, int8_linear_reference, launch
from models.ln_quant import unpack_rows

__all__ = [
    "HEADROOM",
    "fuse_mlp_static",
    "input_amax",
    "linear_from_static",
    "linear_to_static",
    "quantize_static",
    "run_hooked",
    "static_scale",
]

_FLOOR = 1e-8  # a channel never seen nonzero: any scale quantises its zeros exactly
# Each channel's scale covers this multiple of the largest value calibration saw: room for
# inputs beyond the (synthetic) calibration images, at steps 1.5x coarser. SAM ViT-B on the
# photos (random weights, CPU, bench/sam_static_calibration.py; docs/BENCHMARKS.md, issue
# 20), 8 smooth images: embedding error 1.68% and mask IoU 0.9922 at 1.0, 1.52% and
# 0.9932 at 1.5; per-token scales 1.56% and 0.9931.
HEADROOM = 1.5


def static_scale(amax: Tensor) -> Tensor:
    """Per-channel fp32 scales from the calibration's largest magnitudes:
    amax x HEADROOM / 127."""
    return amax.float().clamp(min=_FLOOR) * HEADROOM / 127.0


def quantize_static(x: Tensor, inv_scale: Tensor) -> Tensor:
    """`x [..., K]` -> int8 by fixed per-channel scales (`inv_scale [K]` = 1 / scale):
    rounded half to even and saturated at +-127, as the kernel's epilogue writes it. Plain
    torch ops, so inductor fuses them into the op before when no kernel writes it."""
    return torch.round(x.float() * inv_scale).clamp(-127, 127).to(torch.int8)


def input_amax(
    module: nn.Module, run: Callable[[], object], names: Iterable[str]
) -> dict[str, Tensor]:
    """The largest magnitude each named layer's input reached, per input channel (fp32
    `[K]`), over what `run()` feeds `module` (no grad)."""
    wanted = set(names)
    amax: dict[str, Tensor] = {}
    hooks = []

    def hook_for(name: str) -> Callable[..., None]:
        def record(mod: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            x = inputs[0].detach()
            seen = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen

        return record

    for name, layer in module.named_modules():
        if name in wanted:
            hooks.append(layer.register_forward_pre_hook(hook_for(name)))
    run_hooked(run, hooks)
    return amax


def run_hooked(run: Callable[[], object], hooks: Iterable[RemovableHandle]) -> None:
    """`run()` without grad, then the calibration's `hooks` removed: also when it fails, so
    a model that served a failed calibration pass is left as it was."""
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()


@torch.library.custom_op("serve::linear_to_static", mutates_args=())
def linear_to_static(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    gelu: bool,
    out_inv_scale: Tensor,
) -> Tensor:
    """`gelu?(x W^T + b)` as int8 `[M, N]` by fixed per-column scales (`out_inv_scale [N]`
    = 1 / scale). `x [M, K]` int8 with one scale a row (`x_scale [M]`), or packed rows from
    a `QuantizingLayerNorm` (`x_scale` None)."""
    if x_scale is None:
        x, x_scale = unpack_rows(x, False)
    if not fused_supported(weight.device):
        y = int8_linear_reference(x, x_scale, weight, w_scale, bias, None, gelu, torch.float32)
    elif persistent_for(x, weight):  # Hopper: int8 leaves the epilogue
        config = served_config(False)
        return launch_persistent_static_out(x, x_scale, weight, w_scale, bias,
                                            out_inv_scale=out_inv_scale, gelu=gelu,
                                            gelu_tanh=gelu, config=config)  # fmt: skip
    else:
        y = launch(x, x_scale, weight, w_scale, bias, gelu=gelu, out_dtype=torch.float32)
    return quantize_static(y, out_inv_scale)


@linear_to_static.register_fake
def _(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    gelu: bool,
    out_inv_scale: Tensor,
) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.int8)


@torch.library.custom_op("serve::linear_from_static", mutates_args=())
def linear_from_static(
    q: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """`q [M, K]` int8 (quantised by fixed per-channel scales that `weight` has folded into
    its columns) times `weight^T`, scaled per output channel, + bias + residual."""
    kernel = fused_supported(weight.device)
    if kernel and persistent_for(q, weight):  # the scales are in the weight: none per row
        return launch_persistent(q, None, weight, w_scale, bias, residual, out_dtype=out_dtype,
                                 config=served_config(residual is not None))  # fmt: skip
    ones = torch.ones(q.shape[0], device=q.device)  # elsewhere: a row scale of 1
    if kernel:
        return launch(q, ones, weight, w_scale, bias, residual, out_dtype=out_dtype)
    return int8_linear_reference(q, ones, weight, w_scale, bias, residual, False, out_dtype)


@linear_from_static.register_fake
def _(
    q: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


def fuse_mlp_static(module: nn.Module) -> list[str]:
    """Have each MLP's first Linear write the second's int8 input where the second takes it
    by fixed scales (`DynamicQuantLinear(input_scale=...)`) and the first is an int8 layer of
    the fused kernel with GELU in its epilogue. Returns the first Linears' names. Where the
    first stays in float, the second quantises its input itself (a pass inductor fuses)."""
    from models.mlp_hop import mlp_pairs
    from models.quant_linear import DynamicQuantLinear

    fused = []
    for name, child, (first_attr, second_attr) in mlp_pairs(module):
        first, second = getattr(child, first_attr), getattr(child, second_attr)
        if (
            isinstance(first, DynamicQuantLinear)
            and isinstance(second, DynamicQuantLinear)
            and first.kind == second.kind == "int8"
            and first.kernel == second.kernel == "fused"
            and second.input_inv_scale is not None
            and not first.hop_out
            and isinstance(child.act, nn.Identity)
        ):
            first.output_inv_scale = second.input_inv_scale
            fused.append(f"{name}.{first_attr}" if name else first_attr)
    return fused
