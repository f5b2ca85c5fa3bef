"""bench.attention_sass: SAM's attention kernel compiled for Hopper on this CPU-only machine
(Triton's own ptxas and cuobjdump), its loop over key rows read back from the SASS."""

from __future__ import annotations

from bench.attention_sass import SHAPES, async_copies, compile_for_hopper, loop_opcodes, sass
from bench.gemm_resources import resources


def test_the_window_loops_are_pipelined_and_found_in_the_sass() -> None:
    """As the JIT specialises the served tensors, the windows' key and value tiles go to
    shared memory by asynchronous copies (pipelined; an unaligned pointer would load single
    elements and pipeline nothing). Each loop holds the two products on the tensor cores
    (`HGMMA`) and the exponentials (`MUFU`), neither spills, and the windows read in place
    pay for the padding's bias in fewer than 1.3x the partitioned loop's instructions, both
    arms of the edge windows' branch counted (226 against 178 with Triton 3.6.0)."""
    loops = {}
    for shape in (s for s in SHAPES if s.grid == 14):
        compiled = compile_for_hopper(shape)
        assert async_copies(compiled) >= 2, shape
        ops = loop_opcodes(sass(compiled))
        assert ops["HGMMA"] >= 2 and ops["MUFU"] >= 8, ops
        assert resources(compiled)["stack_bytes"] == 0
        loops[shape.bias] = sum(ops.values())
    assert loops[False] < loops[True] < 1.3 * loops[False], loops


def test_global_rows_without_masks_drop_instructions_and_spill_no_more() -> None:
    """The global grid's key rows fill their slots, so they may load without masks
    (`fused_attention.DENSE_ROWS`): fewer instructions a key row, still pipelined, and no
    more stack under the 168-register cap (Triton 3.6.0, the GPU machine's: 341 against
    368, neither spills; this venv's Triton 3.9 spills both, 256 bytes against 280)."""
    loops, stack = {}, {}
    for shape in (s for s in SHAPES if s.grid == 64):
        compiled = compile_for_hopper(shape)
        assert async_copies(compiled) >= 2, shape
        stack[shape.dense] = resources(compiled)["stack_bytes"]
        loops[shape.dense] = sum(loop_opcodes(sass(compiled)).values())
    assert loops[True] < loops[False], loops
    assert stack[True] <= stack[False], stack
