"""The fused int8 GEMM against bf16 and `torch._int_mm`, on Swin-T's and SAM ViT-B's Linear
shapes (issue 20).

For every product of Swin-T (4 stages: qkv, proj, fc1 with GELU, fc2; tokens = batch x
3136 / 784 / 196 / 49) at each `--swin-batch-sizes`, and of SAM ViT-B's encoder (windowed
blocks: batch x 25 windows x 196 tokens; global blocks: batch x 4096) at `--sam-batch-sizes`,
it times, each inside a CUDA graph of `--reps` calls (no launch overhead, as served):

- `bf16`: `F.linear` in bf16 (cuBLAS, bias in its epilogue), then GELU where the layer has it;
- `int_mm`: `torch._int_mm` (int32 out) with the dequantisation, bias, GELU and cast as one
  compiled pointwise kernel after it: the earlier int8 path;
- `fused`: `models.int8_gemm.launch`, autotuned (the config it chose is printed);
- `fp8`: the same kernel on e4m3 operands (`models.fp8_gemm`, fp32 accumulation).

Activations are already int8 / e4m3 for those. The layers fed by a LayerNorm (qkv, fc1 /
lin1) are also timed with the activation's preparation, from the block's bf16 input:
`ln+bf16` (layer norm, then bf16 `F.linear`), `ln+q+int8` (layer norm and per-token
quantisation compiled by inductor, then the fused kernel: what the model did before),
`lnq+int8` / `lnq+fp8` (`models.ln_quant`: one kernel writes the quantised rows and their
scales, the GEMM reads them in place). On the MLP's first layer (fc1 / lin1) the whole MLP
is timed too, from its int8 / e4m3 input: `mlp bf16`, `mlp int8` (fc1's bf16 output
quantised by an inductor kernel for fc2, as before), `mlp hop int8` / `mlp hop fp8`
(`models.mlp_hop`: fc1 writes it quantised per 128 columns, fc2 reads that).
`max_rel` is the fused kernel's largest difference from the
torch reference (`int8_linear_reference`) relative to the output's largest magnitude;
`equal` whether they are bit for bit equal. `--sweep` also times every candidate config
(`HOPPER_CONFIGS`) per shape, to see what the autotuner had to choose from.

    python3 -m bench.int8_gemm --json .benchdata/int8_gemm.json
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import cuda_time_ms, environment, print_table, write_json
from models.fp8_gemm import fp8_linear, quantize_rows_fp8, quantize_weight_fp8
from models.int8_gemm import (
    HOPPER_CONFIGS,
    int8_linear,
    int8_linear_reference,
    launch,
    quantize_rows,
)
from models.ln_quant import layer_norm_quant, packed_linear
from models.mlp_hop import linear_from_groups, linear_to_groups

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

SWIN_TOKENS = (3136, 784, 196, 49)  # per image, stages 1-4 of Swin-T at 224
SWIN_DIMS = (96, 192, 384, 768)
SAM_DIM = 768
SAM_TOKENS = {"window": 25 * 196, "global": 64 * 64}  # 64x64 grid padded to 70x70 windows


def _block(c: int, mlp1: str, mlp2: str) -> list[tuple[str, int, int, bool]]:
    """A transformer block's products of width c: (layer, K, N, GELU after it)."""
    return [("qkv", c, 3 * c, False), ("proj", c, c, False),
            (mlp1, c, 4 * c, True), (mlp2, 4 * c, c, False)]  # fmt: skip


def shapes(swin_batches: list[int], sam_batches: list[int]) -> list[dict[str, Any]]:
    """Each product: model, layer, M, K, N, GELU after it, residual added after it."""
    out = []
    for batch in swin_batches:
        for stage, (tokens, c) in enumerate(zip(SWIN_TOKENS, SWIN_DIMS, strict=True)):
            m = batch * tokens
            for layer, k, n, gelu in _block(c, "fc1", "fc2"):
                out.append({"model": f"swin-t b{batch}", "layer": f"s{stage + 1}.{layer}",
                            "M": m, "K": k, "N": n, "gelu": gelu})  # fmt: skip
    for batch in sam_batches:
        for kind, tokens in SAM_TOKENS.items():
            m, d = batch * tokens, SAM_DIM
            for layer, k, n, gelu in _block(d, "lin1", "lin2"):
                out.append({"model": f"sam-b b{batch}", "layer": f"{kind}.{layer}",
                            "M": m, "K": k, "N": n, "gelu": gelu})  # fmt: skip
    return out


def graphed_ms(fn: Callable[[], object], reps: int, iters: int) -> float:
    """Milliseconds per call of `fn`, replayed `reps` times per CUDA graph (host clock and no
    graph without CUDA: a smoke run)."""
    if not CUDA:
        return cuda_time_ms(fn, iters, warmup=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, autotune, allocate
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return cuda_time_ms(graph.replay, iters) / reps


def _int_mm_epilogue(
    acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor, gelu: bool
) -> torch.Tensor:
    y = acc.float() * xs[:, None] * ws[None, :] + bias.float()
    return (F.gelu(y) if gelu else y).to(torch.bfloat16)


def _ln_quant_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return quantize_rows(F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))


def _norm_fed_forms(
    x: torch.Tensor,
    bf16_weights: tuple[torch.Tensor, torch.Tensor],
    int8_weights: tuple[torch.Tensor, torch.Tensor],
    fp8_weights: tuple[torch.Tensor, torch.Tensor],
    bias: torch.Tensor,
    gelu: bool,
    prepare: Callable[..., Any],
) -> list[tuple[str, Callable[[], object]]]:
    """The product with its input's preparation from the block's bf16 activation `x`."""
    k = x.shape[1]
    nw, nb = (
        torch.ones(k, device=DEVICE, dtype=x.dtype),
        torch.zeros(k, device=DEVICE, dtype=x.dtype),
    )
    (wb, bb), (wq, ws), (wq8, ws8) = bf16_weights, int8_weights, fp8_weights

    def ln_bf16() -> torch.Tensor:
        y = F.linear(F.layer_norm(x, (k,), nw, nb, 1e-5), wb, bb)
        return F.gelu(y) if gelu else y

    def ln_q_int8() -> torch.Tensor:
        q, s = prepare(x, nw, nb)
        return int8_linear(q, s, wq, ws, bias, None, gelu, torch.bfloat16)

    def lnq(fp8: bool) -> torch.Tensor:
        packed = layer_norm_quant(x, nw, nb, 1e-5, fp8)
        w, s = (wq8, ws8) if fp8 else (wq, ws)
        return packed_linear(packed, w, s, bias, None, gelu, torch.bfloat16)

    return [("ln+bf16", ln_bf16), ("ln+q+int8", ln_q_int8),
            ("lnq+int8", lambda: lnq(False)), ("lnq+fp8", lambda: lnq(True))]  # fmt: skip


def _mlp_forms(
    x: torch.Tensor,
    fc1: dict[str, tuple[torch.Tensor, torch.Tensor]],
    bias: torch.Tensor,
    prepare_rows: Callable[..., Any],
) -> list[tuple[str, Callable[[], object]]]:
    """fc1 (GELU), then fc2 back to the width, from `x`; `fc1`'s weights by form."""
    c, hidden = x.shape[1], fc1["bf16"][0].shape[0]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w2 = torch.randn(c, hidden, device=DEVICE, generator=g) / hidden**0.5
    b2 = torch.randn(c, device=DEVICE, generator=g) * 0.1
    w2q, w2s = quantize_rows(w2)  # per output channel
    w2q8, w2s8 = quantize_weight_fp8(w2)
    w2b, b2b = w2.to(torch.bfloat16), b2.to(torch.bfloat16)
    xq, xs = quantize_rows(x)
    xq8, xs8 = quantize_rows_fp8(x)
    (wb, bb), (wq, ws), (wq8, ws8) = fc1["bf16"], fc1["int8"], fc1["fp8"]

    def mlp_bf16() -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, wb, bb)), w2b, b2b)

    def mlp_int8() -> torch.Tensor:
        h = int8_linear(xq, xs, wq, ws, bias, None, True, torch.bfloat16)
        hq, hs = prepare_rows(h)
        return int8_linear(hq, hs, w2q, w2s, b2, None, False, torch.bfloat16)

    def mlp_hop(fp8: bool) -> torch.Tensor:
        if fp8:
            hq, hs = linear_to_groups(xq8, xs8, wq8, ws8, bias, True)
            return linear_from_groups(hq, hs, w2q8, w2s8, b2, None, torch.bfloat16)
        hq, hs = linear_to_groups(xq, xs, wq, ws, bias, True)
        return linear_from_groups(hq, hs, w2q, w2s, b2, None, torch.bfloat16)

    return [("mlp bf16", mlp_bf16), ("mlp int8", mlp_int8),
            ("mlp hop int8", lambda: mlp_hop(False)),
            ("mlp hop fp8", lambda: mlp_hop(True))]  # fmt: skip


def measure(
    row: dict[str, Any],
    args: argparse.Namespace,
    epilogue: Callable[..., Any],
    prepare: Callable[..., Any],
    prepare_rows: Callable[..., Any],
) -> None:
    m, k, n, gelu = row["M"], row["K"], row["N"], row["gelu"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, generator=g) / k**0.5
    bias = torch.randn(n, device=DEVICE, generator=g) * 0.1
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)  # per output channel
    wb, bb = w.to(torch.bfloat16), bias.to(torch.bfloat16)
    flops = 2 * m * k * n

    def bf16() -> torch.Tensor:
        y = F.linear(x, wb, bb)
        return F.gelu(y) if gelu else y

    def int_mm() -> torch.Tensor:
        return epilogue(torch._int_mm(xq, wq.t()), xs, ws, bias, gelu)

    def fused() -> torch.Tensor:
        if CUDA:
            return launch(xq, xs, wq, ws, bias, None, gelu=gelu, out_dtype=torch.bfloat16)
        return int8_linear(xq, xs, wq, ws, bias, None, gelu, torch.bfloat16)

    xq8, xs8 = quantize_rows_fp8(x)
    wq8, ws8 = quantize_weight_fp8(w)

    def fp8() -> torch.Tensor:
        return fp8_linear(xq8, xs8, wq8, ws8, bias, None, gelu, torch.bfloat16)

    forms: list[tuple[str, Callable[[], object]]] = [
        ("bf16", bf16), ("int_mm", int_mm), ("fused", fused), ("fp8", fp8),
    ]  # fmt: skip
    if row["layer"].split(".")[-1] in ("qkv", "fc1", "lin1"):
        forms += _norm_fed_forms(x, (wb, bb), (wq, ws), (wq8, ws8), bias, gelu, prepare)
    if row["layer"].split(".")[-1] in ("fc1", "lin1"):
        weights = {"bf16": (wb, bb), "int8": (wq, ws), "fp8": (wq8, ws8)}
        forms += _mlp_forms(x, weights, bias, prepare_rows)
    for name, fn in forms:
        try:
            ms = graphed_ms(fn, args.reps, args.iters)
            row[f"{name} ms"] = ms
            row[f"{name} TFLOP/s"] = flops / ms / 1e9
        except Exception as exc:  # one failing form must not lose the others
            row[f"{name} ms"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    for name, base in (("fused", "bf16"), ("fp8", "bf16"), ("lnq+int8", "ln+bf16"),
                       ("lnq+fp8", "ln+bf16"), ("mlp hop int8", "mlp bf16"),
                       ("mlp hop fp8", "mlp bf16")):  # fmt: skip
        if isinstance(row.get(f"{name} ms"), float) and isinstance(row.get(f"{base} ms"), float):
            row[f"{name}/{base}"] = row[f"{base} ms"] / row[f"{name} ms"]
    if CUDA:
        from models.gemm_kernel import _autotuned

        # the autotuner launch() uses; best_config: the one its last call (this shape) ran
        chosen = getattr(_autotuned(HOPPER_CONFIGS), "best_config", None)
        row["config"] = str(chosen).replace("\n", " ")[:90]
    got = fused()
    want = int8_linear_reference(xq, xs, wq, ws, bias, None, gelu, torch.bfloat16)
    row["max_rel"] = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    row["equal"] = bool(torch.equal(got, want))
    if args.sweep and CUDA:
        best = None
        for cfg in HOPPER_CONFIGS:
            if cfg.block_k > max(k, 16):
                continue
            try:
                ms = graphed_ms(
                    functools.partial(launch, xq, xs, wq, ws, bias, None, gelu=gelu,
                                      out_dtype=torch.bfloat16, config=cfg),
                    args.reps, args.iters,
                )  # fmt: skip
            except Exception as exc:  # e.g. out of shared memory for a deep pipeline
                print(f"  {cfg}: {type(exc).__name__}", flush=True)
                continue
            print(f"  {cfg}: {ms:.4f} ms", flush=True)
            best = min(best or (ms, cfg), (ms, cfg), key=lambda t: t[0])
        if best:
            row["sweep best"] = f"{best[0]:.4f} {best[1]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--swin-batch-sizes", nargs="*", type=int, default=[64, 256])
    p.add_argument("--sam-batch-sizes", nargs="*", type=int, default=[8])
    p.add_argument("--reps", type=int, default=10, help="calls per CUDA graph")
    p.add_argument("--iters", type=int, default=10, help="graph replays timed (median)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    started = time.perf_counter()
    env = environment()
    print(env, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    # one compile for every shape: M, K and N symbolic
    epilogue = torch.compile(_int_mm_epilogue, dynamic=True) if CUDA else _int_mm_epilogue
    prepare = torch.compile(_ln_quant_rows, dynamic=True) if CUDA else _ln_quant_rows
    prepare_rows = torch.compile(quantize_rows, dynamic=True) if CUDA else quantize_rows
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for row in shapes(args.swin_batch_sizes, args.sam_batch_sizes):
            if time.perf_counter() - started > args.budget_s:
                print(f"budget spent: skipping {row['model']} {row['layer']}", flush=True)
                continue
            measure(row, args, epilogue, prepare, prepare_rows)
            rows.append(row)
            print(row, flush=True)
    write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    columns = ["model", "layer", "M", "K", "N", "bf16 ms", "int_mm ms", "fused ms", "fused/bf16",
               "fp8 ms", "fp8/bf16", "fused TFLOP/s", "ln+bf16 ms", "ln+q+int8 ms",
               "lnq+int8 ms", "lnq+fp8 ms", "lnq+int8/ln+bf16", "lnq+fp8/ln+bf16",
               "mlp bf16 ms", "mlp int8 ms", "mlp hop int8 ms", "mlp hop fp8 ms",
               "mlp hop int8/mlp bf16", "mlp hop fp8/mlp bf16",
               "max_rel", "equal", "config"]  # fmt: skip
    if args.sweep:
        columns.append("sweep best")
    print_table(rows, columns)


if __name__ == "__main__":
    main()
