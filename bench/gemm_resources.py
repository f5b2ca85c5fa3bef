"""The int8/fp8 GEMM's launch shapes compiled for Hopper without a GPU: which `wgmma` each
issues and what it costs in registers and stack (spills).

Why: our Triton int8 GEMM ran only 1.13x bf16 alone on SAM's encoder shapes (issue 20's
third session) where Hopper's int8 tensor cores run at twice bf16's rate, and device time
is short. Triton compiles for `sm_90` on any machine (its own `ptxas`), and the `cubin`'s
resource usage (`cuobjdump --dump-resource-usage`, shipped with Triton) says how many
programs an SM could hold and whether a shape spills, before a GPU is asked. The code is
this machine's Triton's, which may differ from the GPU machine's (docs/BENCHMARKS.md names
the version with each run).

    python -m bench.gemm_resources
    python -m bench.gemm_resources --formats int8 --gelu --configs 0 1 2
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import print_table
from models.gemm_kernel import HOPPER_CONFIGS, GemmConfig, _kernel

SIGNATURE = {
    "A": "*i8", "B": "*i8", "XS": "*fp32", "WS": "*fp32", "BIAS": "*bf16", "RES": "*bf16",
    "C": "*bf16", "OS": "*fp32", "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32",
    "stride_am": "i32", "stride_bn": "i32", "stride_rm": "i32", "stride_cm": "i32",
    "stride_xs": "i32", "stride_os": "i32",
}  # fmt: skip
# what the served layers tell Triton (16-byte multiples: the loads stay vectors)
DIVISIBLE = ("A", "B", "C", "K", "N", "stride_am", "stride_bn", "stride_cm")
RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)")  # shape and types


def compile_for_hopper(config: GemmConfig, fmt: str, gelu: bool) -> Any:
    """One launch shape of the GEMM (bias in the epilogue, GELU when asked), compiled for
    sm_90 by this machine's Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel()
    names = fn.arg_names
    constants = {
        "HAS_BIAS": True, "HAS_RES": False, "GELU": gelu, "IS_FP8": fmt == "fp8",
        "GROUP_K": 0, "QUANT_OUT": False, "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": 8,
    }  # fmt: skip
    signature = dict(SIGNATURE, **dict.fromkeys(constants, "constexpr"))
    if fmt == "fp8":
        signature["A"] = signature["B"] = "*fp8e4nv"
    source = ASTSource(
        fn,
        signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in DIVISIBLE},
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(compiled: Any, flag: str) -> str:
    """What Triton's own `cuobjdump` prints for the compiled kernel's cubin with `flag`
    (`--dump-resource-usage`, `-sass`)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run(
            [str(tool), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def compile_gluon(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    maxnreg: int,
    divisible: tuple[str, ...] = (),
) -> Any:
    """A Gluon kernel compiled for sm_90 by this machine's Triton (no GPU needed): its
    runtime arguments' types by `signature` (`gluon_descriptor` for a TMA descriptor),
    its constexprs' values, 4 warps under `maxnreg`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names
    source = GluonASTSource(
        fn,
        {**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible},
    )
    options = {"num_warps": 4, "maxnreg": maxnreg}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def gluon_descriptor(rows: int, cols: int, dtype: Any, block: list[int], layout: Any) -> str:
    """The signature type of a TMA descriptor over a `rows x cols` tensor."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    t = torch.empty(rows, cols, dtype=dtype)
    return mangle_type(TensorDescriptor.from_tensor(t, block, layout))


SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")


def setmaxnreg(ptx: str) -> set[tuple[str, int]]:
    """Each warp group's register budgets in a warp-specialised kernel: (inc or dec, count)."""
    return {(d, int(n)) for d, n in SETMAXNREG.findall(ptx)}


def resources(compiled: Any) -> dict[str, Any]:
    """The `wgmma` shapes in the PTX and the cubin's registers, stack and shared memory."""
    text = cuobjdump(compiled, "--dump-resource-usage")
    found = RESOURCES.search(text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[:200]}")
    regs, stack, _, local = (int(g) for g in found.groups())
    shapes = sorted(set(WGMMA.findall(compiled.asm["ptx"])))
    return {
        "wgmma": " ".join(shapes) or "none",
        "registers": regs,
        "stack_bytes": stack,
        "local_bytes": local,
        "shared_kib": round(compiled.metadata.shared / 1024, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8"])
    p.add_argument("--gelu", action="store_true", help="also with GELU in the epilogue")
    p.add_argument(
        "--configs", type=int, nargs="+", default=list(range(len(HOPPER_CONFIGS))),
        help="indices into models.gemm_kernel.HOPPER_CONFIGS",
    )  # fmt: skip
    args = p.parse_args()
    import triton

    rows = []
    for gelu in (False, True) if args.gelu else (False,):
        for fmt in args.formats:
            for i in args.configs:
                config = HOPPER_CONFIGS[i]
                row = {"format": fmt + ("+gelu" if gelu else ""), "config": repr(config)}
                row |= resources(compile_for_hopper(config, fmt, gelu))
                print(row, flush=True)
                rows.append(row)
    print(f"\nTriton {triton.__version__}, sm_90")
    print_table(rows, ["format", "config", "wgmma", "registers", "stack_bytes", "shared_kib"])


if __name__ == "__main__":
    main()
