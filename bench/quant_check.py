"""Every quantised kernel path on the GPU against its torch reference on the CPU, on the
same operands (issue 20): a minute's check before timing them (the CPU tests run the same
kernels only in Triton's interpreter).

Paths: the fused GEMM on int8 and e4m3 operands (per-row scales; bias, GELU, residual),
the LayerNorm writing packed quantised rows (`models.ln_quant`), the GEMM reading those
in place, and the MLP hop (`models.mlp_hop`: fc1's output quantised per 128 columns, fc2
reading it). Shapes: Swin-T's first stage (K = 96) and SAM ViT-B's MLP (768 -> 3072).
Prints one row per path and shape; exits 1 when one is off by more than its tolerance.

    python3 -m bench.quant_check
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from bench.common import print_table
from models.fp8_gemm import fp8_linear, quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import int8_linear, quantize_rows
from models.ln_quant import layer_norm_quant, packed_linear, unpack_rows
from models.mlp_hop import linear_from_groups, linear_to_groups

SHAPES = [(4096 + 17, 96, 384), (8192, 768, 3072)]  # M (not a tile multiple), K, N


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _on(device: str, tensors: list[torch.Tensor | None]) -> list[Any]:
    return [t.to(device) if t is not None else None for t in tensors]


def check(m: int, k: int, n: int, device: str) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) / k**0.5
    bias, residual = torch.randn(n, generator=g) / 4, torch.randn(m, n, generator=g).bfloat16()
    nw, nb = torch.randn(k, generator=g).bfloat16(), torch.randn(k, generator=g).bfloat16()
    w2 = torch.randn(k, n, generator=g) / n**0.5
    weights = {"int8": (quantize_rows(w), quantize_rows(w2)),
               "fp8": (quantize_weight_fp8(w), quantize_weight_fp8(w2))}  # fmt: skip
    rows = []

    def compare(path: str, fn: Callable[[str], Any], tolerance: float) -> None:
        with torch.inference_mode():
            got, want = fn(device), fn("cpu")
        row: dict[str, Any] = {"path": path, "M": m, "K": k, "N": n}
        if isinstance(got, tuple):  # (values, scales): the scales close, the values equal
            row["max_rel"] = _rel(got[1], want[1])  # but at a rare rounding boundary
            same = got[0].view(torch.int8).cpu() == want[0].view(torch.int8)
            row["mismatch"] = float(1 - same.float().mean())
            row["ok"] = row["max_rel"] <= tolerance and row["mismatch"] < 0.01
        else:
            row["max_rel"] = _rel(got, want)
            row["ok"] = row["max_rel"] <= tolerance
        rows.append(row)
        # as it goes: a run cut short (autotuning every path takes minutes) still says
        # which paths it checked
        print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)

    for kind, ((wq, ws), (w2q, w2s)) in weights.items():
        fp8 = kind == "fp8"
        rows_q = quantize_rows_fp8 if fp8 else quantize_rows
        op = fp8_linear if fp8 else int8_linear

        def gemm(dev: str, op: Any = op, rows_q: Any = rows_q, wq: Any = wq, ws: Any = ws) -> Any:
            xq, xs = rows_q(x.float())
            return op(*_on(dev, [xq, xs, wq, ws, bias, residual]), True, torch.bfloat16)

        def norm(dev: str, fp8: bool = fp8) -> Any:
            packed = layer_norm_quant(*_on(dev, [x, nw, nb]), 1e-5, fp8)
            return unpack_rows(packed, fp8)

        def norm_gemm(dev: str, fp8: bool = fp8, wq: Any = wq, ws: Any = ws) -> Any:
            packed = layer_norm_quant(*_on(dev, [x, nw, nb]), 1e-5, fp8)
            return packed_linear(packed, *_on(dev, [wq, ws, bias]), None, False, torch.bfloat16)

        def hop(dev: str, rows_q: Any = rows_q, wq: Any = wq, ws: Any = ws, w2q: Any = w2q,
                w2s: Any = w2s) -> Any:  # fmt: skip
            xq, xs = rows_q(x.float())
            hq, hs = linear_to_groups(*_on(dev, [xq, xs, wq, ws, bias]), True)
            return linear_from_groups(hq, hs, *_on(dev, [w2q, w2s, None, None]), torch.bfloat16)

        compare(f"{kind} gemm", gemm, 2**-7)
        compare(f"{kind} layer_norm_quant", norm, 1e-5)
        compare(f"{kind} lnq + gemm", norm_gemm, 2**-6)
        compare(f"{kind} mlp hop", hop, 2**-5)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cpu: the script's own smoke run")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.quant_check compares the GPU with the CPU: no GPU here")
    rows = [row for m, k, n in SHAPES for row in check(m, k, n, args.device)]
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(name, torch.__version__)
    print_table(rows, ["path", "M", "K", "N", "max_rel", "mismatch", "ok"])
    if not all(row["ok"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
