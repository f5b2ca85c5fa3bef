"""The int8 layer eager against compiled, alone and after a LayerNorm (issue 20; a GPU
script, a smoke test on the CPU).

On the H100, Swin-T with every block Linear int8 (activations quantised in each GEMM) kept
97.07% top-1 agreement with fp32 eager and 86.72% compiled, while every kernel matched its
reference (`bench.quant_check`) and the layer-norm-fused path stayed at 99.22%
(docs/BENCHMARKS.md). The suspect is inductor's own fusion of a LayerNorm with the per-token
quantisation after it. This runs, for Swin-T's shapes, `Linear` alone, `LayerNorm ->
Linear` and `Linear + residual` as `DynamicQuantLinear`, eager and under torch.compile on
the same inputs, and prints each one's error against the fp32 product and compiled
against eager: a row whose compiled error is far above its eager error is the fault.

    python3 -m bench.int8_compile_check
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor, nn

from bench.common import environment, print_table
from models.quant_linear import DynamicQuantLinear

# (tokens, K, N): Swin-T's stage 1 qkv and fc1 at batch 64 (56 x 56 tokens), stage 3 fc1
# (14 x 14), stage 4 fc2 (7 x 7)
SHAPES = [(64 * 3136, 96, 288), (64 * 3136, 96, 384), (64 * 196, 384, 1536), (64 * 49, 3072, 768)]


class NormThenLinear(nn.Module):
    def __init__(self, k: int, linear: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(k)
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.norm(x))


class LinearResidual(nn.Module):
    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.linear(x, residual=residual)


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def check(m: int, k: int, n: int, device: str) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(k + n)
    # activations with a few outlier channels, as transformer activations have
    x = torch.randn(m, k, generator=g) * (1 + 9 * (torch.rand(k, generator=g) > 0.97))
    residual = torch.randn(m, n, generator=g)
    float_linear = nn.Linear(k, n)
    with torch.no_grad():
        float_linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        float_linear.bias.copy_(torch.randn(n, generator=g) / 10)
    norm = nn.LayerNorm(k)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(k, generator=g) / 10)
        norm.bias.copy_(torch.randn(k, generator=g) / 10)
    dev = torch.device(device)
    x, residual = x.to(dev), residual.to(dev)
    float_linear, norm = float_linear.to(dev), norm.to(dev)
    with torch.inference_mode():
        exact = {
            "linear": float_linear(x),
            "norm -> linear": float_linear(norm(x)),
            "linear + residual": float_linear(x) + residual,
        }
    quant = DynamicQuantLinear(float_linear.to(torch.bfloat16)).to(dev)
    normed = NormThenLinear(k, quant).to(dev, torch.bfloat16)
    normed.norm.load_state_dict(norm.state_dict())
    normed = normed.to(dev, torch.bfloat16)
    cases = {
        "linear": (quant, (x.bfloat16(),)),
        "norm -> linear": (normed, (x.bfloat16(),)),
        "linear + residual": (LinearResidual(quant), (x.bfloat16(), residual.bfloat16())),
    }
    rows = []
    for name, (module, inputs) in cases.items():
        torch._dynamo.reset()
        with torch.inference_mode():
            eager = module(*inputs)
            compiled = torch.compile(module)(*inputs)
        rows.append({"case": name, "M": m, "K": k, "N": n,
                     "eager_err": _rel(eager, exact[name]),
                     "compiled_err": _rel(compiled, exact[name]),
                     "compiled_vs_eager": _rel(compiled, eager)})  # fmt: skip
        print(rows[-1], flush=True)  # kept when a run is cut short
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=0, help="cap M (a CPU smoke test)")
    args = parser.parse_args()
    print(environment(), flush=True)
    rows = []
    for m, k, n in SHAPES:
        rows += check(min(m, args.rows) if args.rows else m, k, n, args.device)
    cols = ["case", "M", "K", "N", "eager_err", "compiled_err", "compiled_vs_eager"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
