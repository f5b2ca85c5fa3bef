"""Which int8 matrix products cuBLASLt takes on this GPU, and how fast (issue 20).

The int8 Swin crashed on an H100 with `CUBLAS_STATUS_NOT_SUPPORTED ... cublasLtMatmul with
transpose_mat1 1 transpose_mat2 1 m 288 n 802816 k 96` (its first stage's qkv at batch
256). This calls `torch._int_mm` on that shape and its neighbours, with the activation
row-major (as `Int8DynamicLinear` makes it) and column-major (as a compiled graph may lay
it out), eagerly and inside `torch.compile`, and prints for each: ok or the error, and the
time against the same product in bf16.

    python -m bench.int8_probe
"""

from __future__ import annotations

import argparse

import torch

from bench.common import cuda_time_ms, environment, print_table
from models.quantize import Int8DynamicLinear


def _try(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        return "ok"
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:120]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[3136 * 16, 65536, 3136 * 64,
                                                                   3136 * 256])  # fmt: skip
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    dev = torch.device("cuda")
    rows = []
    for m in args.tokens:
        for k, n in ((96, 288), (96, 384), (384, 96), (768, 2304)):
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
            col = x.t().contiguous().t()  # same values, column-major
            xb = x.to(torch.bfloat16)
            wb = w.to(torch.bfloat16)
            row_ok = _try(lambda x=x, w=w: torch._int_mm(x, w.t()))
            col_ok = _try(lambda col=col, w=w: torch._int_mm(col, w.t()))
            row = {"M": m, "K": k, "N": n, "int8 row-major": row_ok, "int8 col-major": col_ok}
            if row_ok == "ok":
                row["int8 ms"] = cuda_time_ms(lambda x=x, w=w: torch._int_mm(x, w.t()), 20)
            row["bf16 ms"] = cuda_time_ms(lambda xb=xb, wb=wb: xb @ wb.t(), 20)
            rows.append(row)
            print(row, flush=True)
    # the module, eager and compiled, on the failing shape
    linear = torch.nn.Linear(96, 288).to(dev, torch.bfloat16)
    module = Int8DynamicLinear(linear).to(dev)
    x = torch.randn(256, 3136, 96, device=dev, dtype=torch.bfloat16)
    eager = _try(lambda: module(x))
    compiled_fn = torch.compile(module, dynamic=False)
    compiled = _try(lambda: compiled_fn(x))
    print(f"Int8DynamicLinear [256, 3136, 96] -> 288: eager {eager}; compiled {compiled}")
    print(f"\n{env['device']}, torch {env['torch']}, {env['date']}")
    print_table(rows, ["M", "K", "N", "int8 row-major", "int8 col-major", "int8 ms", "bf16 ms"])


if __name__ == "__main__":
    main()
