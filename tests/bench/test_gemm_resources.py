"""bench.gemm_resources: the GEMM compiled for Hopper on this CPU-only machine (Triton's own
ptxas and cuobjdump), its `wgmma` shape and resources read back."""

from __future__ import annotations

from bench.gemm_resources import compile_for_hopper, resources
from models.gemm_kernel import GemmConfig


def test_a_small_tile_compiles_to_hopper_wgmma_without_spills() -> None:
    small = GemmConfig(64, 64, 32, 4, 4)
    plain = resources(compile_for_hopper(small, "int8", gelu=False))
    assert plain["wgmma"] == "m64n64k32.s32.s8.s8"  # int8 in, int32 accumulated
    assert 32 <= plain["registers"] <= 255
    assert plain["stack_bytes"] == plain["local_bytes"] == 0
    assert plain["shared_kib"] > 0  # the pipelined tiles of A and B
    fp8 = resources(compile_for_hopper(small, "fp8", gelu=True))
    assert fp8["wgmma"] == "m64n64k32.f32.e4m3.e4m3"
    assert fp8["registers"] >= plain["registers"]  # GELU's epilogue holds more, never less
