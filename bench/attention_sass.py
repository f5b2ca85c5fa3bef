"""SAM's attention kernel compiled for Hopper without a GPU: its registers and spills, and
what one iteration of its loop over key rows costs in instructions, by opcode.

Why: the kernel is issue-bound (ncu, H200: issue slots 55% busy at three programs an SM,
the softmax's instructions between `wgmma` waits; docs/BENCHMARKS.md, issue 20's
thirteenth session), so instructions per key row are what it pays. The windows read in
place ran 10% slower than partitioned ones: 222 instructions a row against 179, the
padding's bias selected into every padded key and value; 206 once it came in by the
block's constants (226 with the edge windows' branch; seventeenth session). Triton
compiles for `sm_90` here with its own `ptxas`, specialised as its JIT specialises the
served tensors (16-byte aligned pointers and strides: the loads then go by asynchronous
copies, pipelined; unaligned, each thread loads single elements and nothing is
pipelined); `cuobjdump` (shipped with Triton) gives the SASS. The code is this machine's
Triton's; the GPU machine's (3.6.0 in 2026-11) can be installed beside it (`pip install
--target DIR triton==3.6.0`, then `PYTHONPATH=DIR:.`) for its exact counts.

    python -m bench.attention_sass
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, NamedTuple

from bench.common import print_table
from bench.gemm_resources import cuobjdump, resources
from models.sam.fused_attention import KernelConfig, _kernel

POINTERS = ("Q", "K", "V", "RPH", "RPW", "S", "O", "BIAS_K", "BIAS_V")
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_BACK = re.compile(r"\bBRA\s+(?:`\()?(?:0x)?([0-9a-f]+)")


class Shape(NamedTuple):
    """One served launch of ViT-B's attention (heads of 64): the grid a block attends over,
    whether qkv's bias stands for the padded tokens (windows read in place) and whether
    the key rows load without masks (`fused_attention.DENSE_ROWS`, the global grid)."""

    name: str
    grid: int  # the attended grid's side: 64 global, 14 a window
    bias: bool
    dense: bool = False


SHAPES = [
    Shape("global (64x64, cap)", 64, False),
    Shape("global, rows without masks", 64, False, True),
    Shape("window in place", 14, True),
    Shape("window partitioned", 14, False),
]


def compile_for_hopper(shape: Shape) -> Any:
    """The kernel as `launch` builds it for `shape` (bf16, KernelConfig's launch shape and
    register cap), compiled for sm_90 by this machine's Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel()
    names = fn.arg_names
    block_w = max(16, triton.next_power_of_2(shape.grid))
    tables = max(16, triton.next_power_of_2(2 * shape.grid - 1))
    constants = {
        "GRID_H": shape.grid, "BLOCK_W": block_w, "PH": tables, "PW": tables, "HEAD_DIM": 64,
        "BLOCK_M": KernelConfig.block_m, "QK_SCALE": 64**-0.5 * 1.4426950408889634,
        "HAS_BIAS": shape.bias, "DENSE": shape.dense,
    }  # fmt: skip
    signature = {n: "*bf16" if n in POINTERS else "i32" for n in names}
    signature |= dict.fromkeys(constants, "constexpr")
    # what the served tensors tell Triton: strides and the head dim multiples of 16
    # what the JIT tells Triton of the served tensors: 16-byte aligned pointers, strides
    # and head dim multiples of 16
    divisible = [n for n in names if n.startswith("stride_") and "rp" not in n]
    divisible += ["head_dim", *POINTERS]
    source = ASTSource(
        fn,
        signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible},
    )
    options: dict[str, Any] = {"num_warps": KernelConfig.num_warps,
                               "num_stages": KernelConfig.num_stages}  # fmt: skip
    cap = KernelConfig.maxnreg.get((block_w, 64))
    if cap:
        options["maxnreg"] = cap
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass(compiled: Any) -> str:
    return cuobjdump(compiled, "-sass")


def async_copies(compiled: Any) -> int:
    """The loads that go to shared memory by asynchronous copies (Triton's pipelining of
    the loop's key and value tiles): none means each row waits for its loads."""
    return int(compiled.asm["ttgir"].count("async_copy_global_to_local"))


def loop_opcodes(text: str) -> Counter[str]:
    """The opcodes of the largest loop in the SASS (between a backward branch and its
    target: the loop over key rows), each conditional arm counted, predicates dropped."""
    program = [(int(a, 16), body) for a, body in _INSTRUCTION.findall(text)]
    best: list[str] = []
    for address, body in program:
        target = _BACK.search(body)
        if target is None or int(target.group(1), 16) >= address:
            continue
        start = int(target.group(1), 16)
        loop = [b for a, b in program if start <= a <= address]
        if len(loop) > len(best):
            best = loop
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in best)


def main() -> None:
    import triton

    rows = []
    for shape in SHAPES:
        compiled = compile_for_hopper(shape)
        ops = loop_opcodes(sass(compiled))
        found = resources(compiled)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        rows.append({"shape": shape.name, "registers": found["registers"],
                     "stack_bytes": found["stack_bytes"], "async_copies": async_copies(compiled),
                     "loop": sum(ops.values()), "opcodes": top})  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\nTriton {triton.__version__}, sm_90, SAM ViT-B's heads of 64")
    print_table(rows, ["shape", "registers", "stack_bytes", "async_copies", "loop", "opcodes"])


if __name__ == "__main__":
    main()
