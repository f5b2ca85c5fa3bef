"""The persistent TMA int8 GEMM (models/gemm_persistent.py) against bf16 (cuBLAS) and the
tile-per-program int8 kernel (models/gemm_kernel.py) on SAM ViT-B's encoder products.

Why: SAM's encoder needs its GEMMs at well over bf16's rate to reach 600 img/s (issue 20);
the tile-per-program kernel measured 1.13x bf16. Each product of a ViT-B block at
`--batch` (windowed blocks: batch x 25 x 196 tokens, global: batch x 4096), with its
epilogue as the encoder has it (bias; GELU after lin1; lin2's residual), is timed inside a
CUDA graph of `--reps` calls:

- `bf16`: `F.linear` in bf16 (cuBLAS; bias in its epilogue), then GELU / the residual;
- `tiled`: models.gemm_kernel.launch, autotuned over its Hopper configs;
- `persistent`: models.gemm_persistent.launch_persistent, every config of `--configs`
  (default: `SWEEP`) timed, the fastest kept (its config printed); configs that do not
  compile or fit are skipped and counted.

The GELU layers run again as `~tanh` rows: GELU's tanh form, ours with tanh as one SFU
instruction, bf16's as cuBLASLt's GELU_BIAS epilogue (which computes that form too).
`max_rel` is the persistent kernel's largest difference from the torch reference
(`int8_linear_reference`, then the row's GELU) relative to the output's largest magnitude.

    python3 -m bench.int8_persistent --batch 8
    python3 -m bench.int8_persistent --batch 8 --mlp     # the MLP: bf16, int8, the hop
    TRITON_INTERPRET=1 python -m bench.int8_persistent --batch 1 --tokens 64 --configs 0
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, write_json
from bench.int8_gemm import CUDA, DEVICE, SAM_DIM, SAM_TOKENS, graphed_ms, shapes
from models.gemm_kernel import HOP_GROUP
from models.gemm_persistent import (
    INTERPRETER_CONFIG,
    SWEEP,
    PersistentConfig,
    launch_persistent,
    launch_persistent_quant_out,
    launch_persistent_static_out,
    served_config,
)
from models.int8_gemm import int8_linear_reference, launch, quantize_rows
from models.ln_quant import pack_rows


def sam_products(batch: int, tokens: dict[str, int]) -> list[dict[str, Any]]:
    """A ViT-B block's products: layer, M, K, N, GELU after it, residual added in it."""
    d = SAM_DIM
    out = []
    for kind, per_image in tokens.items():
        m = batch * per_image
        for layer, k, n, gelu, res in (("qkv", d, 3 * d, False, False),
                                       ("proj", d, d, False, False),
                                       ("lin1", d, 4 * d, True, False),
                                       ("lin2", 4 * d, d, False, True)):  # fmt: skip
            out.append({"layer": f"{kind}.{layer}", "M": m, "K": k, "N": n,
                        "gelu": gelu, "residual": res, "tanh": False})  # fmt: skip
            if gelu:  # GELU's tanh form: ours with tanh by the SFU, bf16's in cuBLASLt
                out.append({**out[-1], "layer": f"{kind}.{layer}~tanh", "tanh": True})
    return out


def swin_products(batch: int) -> list[dict[str, Any]]:
    """Swin-T's block products at `batch` (none for 0), as bench.int8_gemm lists them; the
    GELU layers in the tanh form only (what the persistent kernel serves)."""
    rows = shapes([batch], []) if batch else []
    return [{"layer": f"swin b{batch} {r['layer']}" + ("~tanh" if r["gelu"] else ""),
             "M": r["M"], "K": r["K"], "N": r["N"], "gelu": r["gelu"],
             "residual": False, "tanh": r["gelu"]} for r in rows]  # fmt: skip


def measure(
    row: dict[str, Any],
    configs: list[PersistentConfig],
    reps: int,
    iters: int,
    packed: bool = False,
) -> None:
    m, k, n, gelu = row["M"], row["K"], row["N"], row["gelu"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, generator=g) / k**0.5
    bias = torch.randn(n, device=DEVICE, generator=g) * 0.1
    res = (
        torch.randn(m, n, device=DEVICE, generator=g).to(torch.bfloat16)
        if row["residual"]
        else None
    )
    xq, xs = quantize_rows(x)
    if packed:  # as the quantising norms write it: each row's K bytes, then its scale
        xq = pack_rows(xq, xs)[:, :k]
    wq, ws = quantize_rows(w)
    wb, bb = w.to(torch.bfloat16), bias.to(torch.bfloat16)
    flops = 2 * m * k * n

    def bf16() -> torch.Tensor:
        if row["tanh"]:  # cuBLASLt's GELU_BIAS epilogue (its GELU is the tanh form)
            return torch._addmm_activation(bb, x, wb.t(), use_gelu=True)
        y = F.linear(x, wb, bb)
        y = F.gelu(y) if gelu else y
        return y + res if res is not None else y

    def tiled() -> torch.Tensor:
        return launch(xq, xs, wq, ws, bias, res, gelu=gelu, out_dtype=torch.bfloat16)

    def persistent(cfg: PersistentConfig) -> Callable[[], torch.Tensor]:
        return lambda: launch_persistent(
            xq, xs, wq, ws, bias, res, gelu=gelu, gelu_tanh=row["tanh"], config=cfg
        )

    for name, fn in (("bf16", bf16), ("tiled", tiled)):
        if name == "tiled" and not CUDA:
            continue  # the interpreter runs it in tests/models; nothing to time here
        row[f"{name} ms"] = graphed_ms(fn, reps, iters)
    best: tuple[float, PersistentConfig] | None = None
    failed = 0
    for cfg in configs:
        try:
            ms = graphed_ms(persistent(cfg), reps, iters)
        except Exception as exc:  # out of shared memory, or a form this Triton cannot build
            failed += 1
            print(f"  {row['layer']} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"  {row['layer']} {cfg}: {ms:.4f} ms", flush=True)
        if best is None or ms < best[0]:
            best = (ms, cfg)
    row["failed configs"] = failed
    if best is not None:
        row["persistent ms"], row["config"] = best[0], str(best[1])
        got = persistent(best[1])()
        want = int8_linear_reference(xq, xs, wq, ws, bias, res, gelu, torch.bfloat16)
        if row["tanh"]:  # against the same product through the tanh form in torch
            want = F.gelu(int8_linear_reference(xq, xs, wq, ws, bias, res, False,
                                                torch.float32), approximate="tanh")  # fmt: skip
        row["max_rel"] = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    for name in ("bf16", "tiled", "persistent"):
        if isinstance(row.get(f"{name} ms"), float):
            row[f"{name} TFLOP/s"] = flops / row[f"{name} ms"] / 1e9
    for name in ("tiled", "persistent"):
        if isinstance(row.get(f"{name} ms"), float):
            row[f"{name}/bf16"] = row["bf16 ms"] / row[f"{name} ms"]


def mlp_forms(m: int, d: int) -> dict[str, Callable[[], torch.Tensor]]:
    """SAM's MLP on `m` tokens of width `d` (lin1 with GELU's tanh form to 4d, lin2 back with
    the residual), three ways: `bf16` (cuBLASLt's GELU epilogue, then F.linear and the
    add), `int8` (the persistent kernel twice, lin1's bf16 output quantised per row between
    them by a compiled `quantize_rows`, as inductor does in the encoder), `hop` (lin1
    writes int8 per 128 columns, lin2 reads those groups: models.mlp_hop's path), and
    `hop lin2 128-wide` (the same with lin2's tiles 128 columns wide: fewer registers for
    its fp32 sum), and `static` (lin1 writes int8 by fixed per-column scales, lin2 reads it
    with those scales folded into its weight: models.gemm_persistent's fixed-scale path)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, d, device=DEVICE, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(4 * d, d, device=DEVICE, generator=g) / d**0.5
    w2 = torch.randn(d, 4 * d, device=DEVICE, generator=g) / (4 * d) ** 0.5
    b1, b2 = (torch.randn(n, device=DEVICE, generator=g) * 0.1 for n in (4 * d, d))
    res = torch.randn(m, d, device=DEVICE, generator=g).to(torch.bfloat16)
    xq, xs = quantize_rows(x)
    (w1q, w1s), (w2q, w2s) = quantize_rows(w1), quantize_rows(w2)
    w1b, w2b, b1b, b2b = (t.to(torch.bfloat16) for t in (w1, w2, b1, b2))
    quantize = torch.compile(quantize_rows, dynamic=False) if CUDA else quantize_rows

    def bf16() -> torch.Tensor:
        h = torch._addmm_activation(b1b, x, w1b.t(), use_gelu=True)
        return F.linear(h, w2b, b2b) + res

    def int8() -> torch.Tensor:
        h = launch_persistent(xq, xs, w1q, w1s, b1, gelu=True, gelu_tanh=True,
                              config=served_config(False))  # fmt: skip
        hq, hs = quantize(h)
        return launch_persistent(hq, hs, w2q, w2s, b2, res, config=served_config(True))

    def hop(lin2: PersistentConfig) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            lin1 = served_config(False, quant_out=True)
            q, qs = launch_persistent_quant_out(xq, xs, w1q, w1s, b1, gelu=True, gelu_tanh=True,
                                                config=lin1)  # fmt: skip
            return launch_persistent(q, qs, w2q, w2s, b2, res, group_k=HOP_GROUP, config=lin2)

        return run

    # fixed per-column scales for lin1's output (its peaks here; a calibration in a model),
    # folded into lin2's weight columns: no row maximum anywhere, lin2 a plain int8 product
    h = launch_persistent(xq, xs, w1q, w1s, b1, gelu=True, gelu_tanh=True,
                          config=served_config(False)).float()  # fmt: skip
    peak = h.abs().amax(0).clamp(min=1e-6)
    inv = 127.0 / peak
    w2fq, w2fs = quantize_rows(w2 * (peak / 127.0)[None, :])

    def static() -> torch.Tensor:
        q = launch_persistent_static_out(xq, xs, w1q, w1s, b1, out_inv_scale=inv, gelu=True,
                                         gelu_tanh=True, config=served_config(False))  # fmt: skip
        return launch_persistent(q, None, w2fq, w2fs, b2, res, config=served_config(True))

    narrow = PersistentConfig(128, 128, 128, 4, 8, subtile=False)
    return {"bf16": bf16, "int8": int8, "hop": hop(served_config(True)),
            "hop lin2 128-wide": hop(narrow), "static": static}  # fmt: skip


def measure_mlp(batch: int, reps: int, iters: int) -> list[dict[str, Any]]:
    """`mlp_forms` on a window block's and a global block's tokens at `batch`: ms each, and
    each form's largest difference from `int8` relative to its output's magnitude."""
    rows = []
    for kind, per_image in SAM_TOKENS.items():
        forms = mlp_forms(batch * per_image, SAM_DIM)
        want = forms["int8"]().float()
        for name, fn in forms.items():
            got = fn().float()
            off = float((got - want).abs().max() / want.abs().max())
            rows.append({"layer": f"{kind}.mlp {name}", "M": batch * per_image,
                         "K": SAM_DIM, "N": 4 * SAM_DIM,
                         "ms": graphed_ms(fn, reps, iters), "vs int8 max_rel": off})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per image for every product (a smoke run); default SAM's",
    )
    p.add_argument(
        "--swin-batch",
        type=int,
        default=0,
        help="also Swin-T's products at this batch (its four stages)",
    )
    p.add_argument("--configs", type=int, nargs="+", default=None, help="indices into SWEEP")
    p.add_argument("--layers", nargs="+", default=None, help="e.g. global.lin1 window.qkv")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--mlp", action="store_true", help="the MLP's forms only (`mlp_forms`)")
    p.add_argument(
        "--packed", action="store_true",
        help="the input's rows K + 16 bytes apart, as the quantising layer norms write them "
        "(models.ln_quant.pack_rows)",
    )  # fmt: skip
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    if args.mlp:
        mlp = measure_mlp(args.batch, args.reps, args.iters)
        print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, batch {args.batch}")
        print_table(mlp, list(mlp[0]))
        if args.json:
            write_json(Path(args.json), {"environment": env, "rows": mlp})
        return
    tokens = {"tokens": args.tokens} if args.tokens else SAM_TOKENS
    rows = [r for r in sam_products(args.batch, tokens) + swin_products(args.swin_batch)
            if args.layers is None or r["layer"] in args.layers]  # fmt: skip
    if args.configs is not None:
        configs = [SWEEP[i] for i in args.configs]
    else:
        configs = list(SWEEP) if CUDA else [INTERPRETER_CONFIG]
    for row in rows:
        measure(row, configs, args.reps, args.iters, args.packed)
        row.pop("tanh")
        print(row, flush=True)
    total: dict[str, Any] = {"layer": "block (sum, exact GELU)", "M": "", "K": "", "N": ""}
    for name in ("bf16", "tiled", "persistent"):
        times = [r.get(f"{name} ms") for r in rows if "~" not in r["layer"]]
        if times and all(isinstance(t, float) for t in times):
            total[f"{name} ms"] = sum(times)
    if "persistent ms" in total and "bf16 ms" in total:
        total["persistent/bf16"] = total["bf16 ms"] / total["persistent ms"]
    if "tiled ms" in total and "bf16 ms" in total:
        total["tiled/bf16"] = total["bf16 ms"] / total["tiled ms"]
    rows.append(total)
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}, batch {args.batch}")
    cols = ["layer", "M", "K", "N", "bf16 ms", "tiled ms", "persistent ms", "tiled/bf16",
            "persistent/bf16", "persistent TFLOP/s", "config", "max_rel",
            "failed configs"]  # fmt: skip
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    if args.json:
        write_json(Path(args.json), {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
