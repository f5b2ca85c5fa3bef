"""bench.attention_sass: SAM's attention kernel compiled for Hopper on this CPU-only machine
(Triton's own ptxas and cuobjdump), its loop over key rows read back from the SASS."""

from __future__ import annotations

from bench.attention_sass import SHAPES, compile_for_hopper, loop_opcodes, sass
from bench.gemm_resources import resources


def test_the_window_loops_are_found_and_in_place_costs_little_more_than_partitioned() -> None:
    """The windows read in place pay for the padding only in edge windows' branches: their
    loop, both arms counted, stays within a sixth of the partitioned one's (the selects it
    held before made it 1.21x with Triton 3.6.0). Each loop holds the two products on the
    tensor cores (`HGMMA`) and the exponentials (`MUFU`), and neither spills."""
    loops = {}
    for shape in (s for s in SHAPES if s.grid == 14):
        compiled = compile_for_hopper(shape)
        ops = loop_opcodes(sass(compiled))
        assert ops["HGMMA"] >= 2 and ops["MUFU"] >= 8, ops
        assert resources(compiled)["stack_bytes"] == 0
        loops[shape.bias] = sum(ops.values())
    assert loops[False] < loops[True] < 1.17 * loops[False], loops
