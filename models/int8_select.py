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
from models.swin.config import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "Int8Choice",
    "Int8Measure",
    "calibration_on",
    "calibration_run",
    "choose_float_layers",
    "int8_include",
    "int8_layer_errors",
    "leaves_images",
    "measure_int8",
    "smooth_images",
    "synthetic_images",
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


def leaves_images(
    n: int,
    size: int,
    *,
    seed: int = 0,
    padded: bool = False,
    device: torch.device | None = None,
) -> Tensor:
    """`[n, 3, size, size]` "dead leaves" images, normalised as the models' inputs: discs of
    flat colours laid over each other, radii drawn with density r^-3 (size/200 to size/4),
    a faint texture on top. The model reproduces photos' scale invariance and, unlike
    `smooth_images`, their sharp edges and flat regions, which drive SAM's activations
    harder: on random ViT-B the photos' peaks passed 1.5x those of 8 smooth images in 5.4%
    of lin2's input channels and 7.4% of the attention projections', against 0.45% and
    2.5% for 8 of these, padded (a CPU measurement, docs/BENCHMARKS.md, issue 20).
    `padded`: zeros below or right of a random 55-100% of the side, as SAM pads a photo
    to its square."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.arange(size, dtype=torch.float32).view(-1, 1)
    xs = torch.arange(size, dtype=torch.float32).view(1, -1)
    rmin, rmax = size / 200, size / 4
    # ImageNet's statistics, by which SAM (x255) and Swin both normalise their pixels
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    out = torch.empty(n, 3, size, size)
    for i in range(n):
        canvas = torch.rand(3, 1, 1, generator=g).expand(3, size, size).clone()
        u = torch.rand(1500, generator=g)
        radii = (rmin**-2 - u * (rmin**-2 - rmax**-2)) ** -0.5  # inverse CDF of r^-3
        centres = torch.rand(1500, 2, generator=g) * size
        # colours along a grey axis with some chroma, as most of a photo's are
        colours = torch.rand(1500, 1, generator=g) + 0.2 * torch.randn(1500, 3, generator=g)
        discs = zip(radii.tolist(), centres.tolist(), colours.clamp(0, 1), strict=True)
        for r, (cy, cx), colour in discs:
            y0, y1 = max(0, int(cy - r)), min(size, int(cy + r) + 1)
            x0, x1 = max(0, int(cx - r)), min(size, int(cx + r) + 1)
            if y0 >= y1 or x0 >= x1:
                continue
            inside = (ys[y0:y1] - cy) ** 2 + (xs[:, x0:x1] - cx) ** 2 < r * r
            patch = canvas[:, y0:y1, x0:x1]
            canvas[:, y0:y1, x0:x1] = torch.where(inside, colour.view(3, 1, 1), patch)
        texture = 0.03 * smooth_images(1, size, seed=seed * 1000 + i)[0]
        image = ((canvas + texture).clamp(0, 1) - mean) / std
        if padded:
            short = int(size * (0.55 + 0.45 * float(torch.rand(1, generator=g))))
            if float(torch.rand(1, generator=g)) < 0.5:
                image[:, short:, :] = 0
            else:
                image[:, :, short:] = 0
        out[i] = image
    return out.to(device) if device is not None else out


# Which synthetic images `calibration_run` makes, read at each call (a bench measures
# both): None, each model its measured kind (`synthetic_images`), or "smooth"
# (`smooth_images`) / "leaves" (`leaves_images`) for every model
SYNTHETIC: str | None = None


def synthetic_images(
    n: int, size: int, *, seed: int = 0, padded: bool = False, device: torch.device | None = None
) -> Tensor:
    """`SYNTHETIC`'s kind of images; by default dead leaves for a model of padded inputs
    (SAM's encoders), smooth ones for the others (Swin). SAM's int8 encoder calibrated on
    leaves met mask IoU 0.9903 against 0.9878 on smooth images, embedding error 1.73%
    against 1.85% (H100, random ViT-B, the photos; docs/BENCHMARKS.md, issue 20); Swin's
    int8 met its agreement target on smooth images and was not measured on leaves.
    `padded` for the leaves only: smooth ones fill the square, as they always have."""
    kind = SYNTHETIC if SYNTHETIC is not None else ("leaves" if padded else "smooth")
    if kind == "leaves":
        return leaves_images(n, size, seed=seed, padded=padded, device=device)
    if kind != "smooth":
        raise ValueError(f"int8_select.SYNTHETIC must be smooth or leaves, not {kind!r}")
    return smooth_images(n, size, seed=seed, device=device)


def calibration_run(
    size: int, images: int, seed: int = 0, chunk: int | None = None, padded: bool = False
) -> Callable[[nn.Module], object]:
    """What `quantize_linears(calibrate=...)` takes: run a model of `[B, 3, size, size]`
    inputs on `images` `synthetic_images`, on the device and in the dtype of its weights,
    `chunk` images a call (all at once by default): SAM's global attention with its dense
    bias, run eagerly at load, holds batch x 12 x 4096^2 scores at 1024 px. `padded`: the
    model sees photos padded to its square (SAM)."""

    def run(module: nn.Module) -> object:
        weight = next(module.parameters())
        x = synthetic_images(images, size, seed=seed, padded=padded, device=weight.device)
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
