"""Which Linear layers to quantize to int8: by each layer's measured output error.

Per-token int8 activations lose most where a token's values are dominated by a few large
ones (after GELU, in attention outputs): the absmax scale then leaves the small values a
handful of levels. How much, and where, depends on the weights and the inputs, so it is
measured: each candidate layer's input is taken from the float model on sample images,
quantized as `Int8DynamicLinear` would (per token, per output channel, the arithmetic of
`models.int8_gemm.int8_linear`), and compared with the float product. The worst
layers stay in the serving dtype; patch embedding and the classifier head are never
candidates (`models.optimize`'s filters).

The measure is one forward pass of the float model (every layer sees the float model's
activations, so one layer's error does not inflate the next's), cheap next to compiling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.fp8_gemm import quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import quantize_rows
from models.mlp_static import quantize_static, run_hooked, static_scale

__all__ = [
    "Int8Choice",
    "Int8Measure",
    "calibration_on",
    "calibration_run",
    "choose_float_layers",
    "int8_include",
    "int8_layer_errors",
    "measure_int8",
    "smooth_images",
]

log = logging.getLogger(__name__)

_EPS = 1e-12


def _quantize_weight(weight: Tensor, kind: str = "int8") -> tuple[Tensor, Tensor]:
    if kind == "fp8":
        return quantize_weight_fp8(weight.float())
    return quantize_rows(weight.detach())  # per output channel, as DynamicQuantLinear


@dataclass(frozen=True)
class Int8Measure:
    """Per candidate layer: the relative error of its int8 product; the mean of its input
    over every token seen (float64; for bias correction); and the input's second moment
    `X^T X` (fp32 `[K, K]`, for GPTQ; `hessians=True` only: K^2 floats per layer)."""

    errors: dict[str, float]
    input_means: dict[str, Tensor]
    hessians: dict[str, Tensor]


def measure_int8(
    module: nn.Module,
    run: Callable[[], object],
    candidates: Callable[[str, nn.Linear], bool],
    *,
    hessians: bool = False,
    kind: str = "int8",
    grouped: frozenset[str] = frozenset(),
    static: dict[str, Tensor] | None = None,
) -> Int8Measure:
    """`||q(x) W_q^T - x W^T|| / ||x W^T||` for each candidate Linear of `module`, over
    the inputs it receives while `run()` runs the float `module` (no grad), in float64;
    each layer's mean input, and with `hessians` its input's `X^T X`. `kind`: the
    quantisation measured, "int8" or "fp8" (e4m3, `models.fp8_gemm`'s scales); the layers
    named in `grouped` have their input quantised per row and 128 columns, as the MLP's
    second Linear gets it from the first (`models.mlp_hop`); those in `static` (their
    input's largest magnitude per channel, `models.mlp_static.input_amax`) by those fixed
    scales folded into the weight, and their mean input and `X^T X` are the scaled
    input's, as `Int8DynamicLinear(input_scale=...)` takes them."""
    layers = {
        name: layer
        for name, layer in module.named_modules()
        if isinstance(layer, nn.Linear) and candidates(name, layer)
    }
    sums = {name: [0.0, 0.0] for name in layers}  # squared error, squared reference
    totals: dict[str, Tensor] = {}
    moments: dict[str, Tensor] = {}
    counts = dict.fromkeys(layers, 0)
    hooks = []

    fixed = static or {}
    if fixed and kind != "int8":
        raise ValueError("fixed input scales: int8 only")

    def hook_for(name: str, layer: nn.Linear) -> Callable[..., None]:
        inv = 1.0 / static_scale(fixed[name]) if name in fixed else None
        weight = layer.weight if inv is None else layer.weight.float() / inv[None, :]
        wq, ws = _quantize_weight(weight, kind)
        rows = quantize_rows_fp8 if kind == "fp8" else quantize_rows

        def measure(mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            x = inputs[0].reshape(-1, layer.in_features)
            if inv is not None:  # models.mlp_static: the product in the scaled input's terms
                got = (quantize_static(x, inv).float() @ wq.float().t()) * ws[None, :]
                x = x.float() * inv  # the statistics below: the scaled input's
            elif name in grouped:
                from models.mlp_hop import HOP_GROUP, quantize_groups

                gq, gs = quantize_groups(x, kind == "fp8")
                xd = (gq.float().unflatten(1, (-1, HOP_GROUP)) * gs[..., None]).flatten(1)
                got = (xd @ wq.float().t()) * ws[None, :]
            else:
                xq, xs = rows(x)
                # the int8 (or fp8) product in fp32 (exact but for the rounding of sums past
                # 2^24; no kernel to tune, any device), then the kernel's dequantisation
                got = (xq.float() @ wq.float().t()) * xs[:, None] * ws[None, :]
            want = torch.nn.functional.linear(x.float(), weight.float())
            sums[name][0] += float((got.double() - want.double()).square().sum())
            sums[name][1] += float(want.double().square().sum())
            total = x.double().sum(dim=0)
            totals[name] = totals[name] + total if name in totals else total
            counts[name] += x.shape[0]
            if hessians:
                xf = x.float()
                moment = xf.t() @ xf
                moments[name] = moments[name] + moment if name in moments else moment

        return measure

    for name, layer in layers.items():
        hooks.append(layer.register_forward_hook(hook_for(name, layer)))
    run_hooked(run, hooks)
    errors = {name: (err / max(ref, _EPS)) ** 0.5 for name, (err, ref) in sums.items()}
    means = {name: totals[name] / counts[name] for name in totals}
    return Int8Measure(errors, means, moments)


def int8_layer_errors(
    module: nn.Module,
    run: Callable[[], object],
    candidates: Callable[[str, nn.Linear], bool],
) -> dict[str, float]:
    """`measure_int8`'s errors alone."""
    return measure_int8(module, run, candidates).errors


@dataclass(frozen=True)
class Int8Choice:
    """The outcome: layers to quantize, layers kept in float (worst first), their errors,
    and each measured layer's mean input and `X^T X` (for `Int8DynamicLinear`'s bias
    correction and GPTQ rounding)."""

    quantized: tuple[str, ...]
    kept_float: tuple[str, ...]
    errors: dict[str, float]
    input_means: dict[str, Tensor]
    hessians: dict[str, Tensor]


def choose_float_layers(
    errors: dict[str, float], *, max_error: float, max_kept: float = 0.25
) -> tuple[str, ...]:
    """The layers to keep in float: those whose error exceeds `max_error`, worst first, at
    most `max_kept` (a fraction) of the candidates, so that int8 still covers most FLOPs."""
    worst = sorted(errors, key=lambda name: errors[name], reverse=True)
    over = [name for name in worst if errors[name] > max_error]
    return tuple(over[: int(max_kept * len(errors))])


def int8_include(
    module: nn.Module,
    run: Callable[[], object],
    candidates: Callable[[str, nn.Linear], bool],
    *,
    max_error: float,
    max_kept: float = 0.25,
    hessians: bool = False,
    kind: str = "int8",
    grouped: frozenset[str] = frozenset(),
    static: dict[str, Tensor] | None = None,
) -> tuple[Callable[[str, nn.Linear], bool], Int8Choice]:
    """A filter for `quantize_linears`: `candidates` less the layers whose int8 error on
    `run()`'s inputs is past `max_error` (see `choose_float_layers`); and the choice."""
    measured = measure_int8(module, run, candidates, hessians=hessians, kind=kind,
                            grouped=grouped, static=static)  # fmt: skip
    errors = measured.errors
    kept = choose_float_layers(errors, max_error=max_error, max_kept=max_kept)
    chosen = tuple(name for name in errors if name not in kept)
    choice = Int8Choice(chosen, kept, errors, measured.input_means, measured.hessians)
    if kept:
        worst = ", ".join(f"{n} {errors[n]:.4f}" for n in kept)
        log.info("%s: %d of %d layers kept in float (error > %.4f): %s",
                 kind, len(kept), len(errors), max_error, worst)  # fmt: skip
    excluded = set(kept)

    def include(name: str, layer: nn.Linear) -> bool:
        return candidates(name, layer) and name not in excluded

    return include, choice


def smooth_images(
    n: int, size: int, *, seed: int = 0, device: torch.device | None = None
) -> Tensor:
    """`[n, 3, size, size]` images with natural images' spectrum roughly (smooth, a few large
    shapes, some texture; about zero mean, unit spread per channel, like normalized pixels)
    for when no photos are at hand: noise at 4 scales, upsampled and summed."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, 3, size, size)
    for cells, weight in ((4, 1.0), (16, 0.5), (64, 0.25), (size, 0.125)):
        noise = torch.randn(n, 3, cells, cells, generator=g)
        out += weight * nn.functional.interpolate(
            noise, size=(size, size), mode="bicubic", align_corners=False
        )
    out = (out - out.mean(dim=(2, 3), keepdim=True)) / out.std(dim=(2, 3), keepdim=True)
    return out.to(device) if device is not None else out


def calibration_run(
    size: int, images: int, seed: int = 0, chunk: int | None = None
) -> Callable[[nn.Module], object]:
    """What `quantize_linears(calibrate=...)` takes: run a model of `[B, 3, size, size]`
    inputs on `images` `smooth_images`, on the device and in the dtype of its weights,
    `chunk` images a call (all at once by default): SAM's global attention with its dense
    bias, run eagerly at load, holds batch x 12 x 4096^2 scores at 1024 px."""

    def run(module: nn.Module) -> object:
        weight = next(module.parameters())
        x = smooth_images(images, size, seed=seed, device=weight.device)
        return calibration_on(x, chunk)(module)

    return run


def calibration_on(images: Tensor, chunk: int | None = None) -> Callable[[nn.Module], object]:
    """`calibration_run` on given model inputs (`[B, 3, S, S]`, pre-processed photos like
    the served ones: `SERVE_CALIBRATION_IMAGES`), moved to the device and dtype of the
    model's weights, `chunk` a call."""

    def run(module: nn.Module) -> object:
        weight = next(module.parameters())
        x = images.to(weight.device, weight.dtype)
        step = chunk or len(x)
        outs = [module(x[i : i + step]) for i in range(0, len(x), step)]
        return outs[0] if len(outs) == 1 else outs

    return run
