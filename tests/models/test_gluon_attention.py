"""The warp-specialised Gluon global attention (models/sam/gluon_attention.py) compiled for
an H100 (sm_90) by this machine's Triton: Gluon has no interpreter, so what the CPU can
check is what the kernel compiles to and which layers it takes; its numbers are checked
on the GPU against the Triton kernel (bench/gluon_attention.py, docs/BENCHMARKS.md,
issue 20)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.gemm_resources import resources, setmaxnreg
from bench.gluon_attention import compile_for_hopper
from models.sam import gluon_attention
from models.sam.gluon_attention import gluon_attention_supported, launch_gluon_attention


def test_it_compiles_to_two_overlapping_consumers_and_a_producer() -> None:
    compiled = compile_for_hopper()
    ptx = compiled.asm["ptx"]
    found = resources(compiled)
    # the scores and p . v by 64-wide wgmma; the tables' products 128 wide
    assert found["wgmma"] == "m64n128k16.f32.bf16.bf16 m64n64k16.f32.bf16.bf16", found
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    regs = {str(n) for _, n in setmaxnreg(ptx)}
    budgets = gluon_attention.CONSUMER_REGISTERS, gluon_attention.PRODUCER_REGISTERS
    assert {str(n) for n in budgets} <= regs
    # each consumer's loop waits for its new scores with p . v still in flight, then for
    # p . v after the softmax
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)) == 2
    # an exponential a score a thread (32 of a 64 x 64 tile over 128 threads) and one a row
    # for the rescale, in each consumer's first row and its loop
    assert len(re.findall(r"ex2\.approx", ptx)) == 2 * 2 * (32 + 2)
    # TMA: the two tables, a query row for each consumer, a key and a value row (all from
    # the producer); the output by a TMA store from each consumer
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx))
    assert loads == 2 + 2 + 2, loads
    stores = re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::\w+\.bulk_group", ptx)
    assert len(stores) == 2
    # the scores' tile is never passed through shared memory to become p . v's operand
    loop_rest = ptx.split("wgmma.wait_group.sync.aligned 1;")[1].split("bra.uni")[0]
    assert "st.shared.v" not in loop_rest


def test_its_output_can_leave_int8_for_the_projection() -> None:
    """`out_inv_scale`: each consumer's tile scaled by its head's 64 inverse scales, rounded
    to int8 (no float-to-integer conversion: models.triton_quant) and stored by TMA as
    int8, with nothing spilled and the loop as before."""
    compiled = compile_for_hopper(quant_out=True)
    ptx = compiled.asm["ptx"]
    found = resources(compiled)
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)) == 2
    stores = re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::\w+\.bulk_group", ptx)
    assert len(stores) == 2
    # the scales a column: one load of 64 fp32 across the warp group's columns, each consumer
    assert re.search(r"ld\.global(\.\w+)*\.b32", ptx), "no load of the scales"
    assert "cvt.rni" not in ptx and "cvt.rzi" not in ptx
    assert compiled.metadata.shared < compile_for_hopper().metadata.shared  # int8 staging


def test_only_the_layers_it_was_written_for_are_taken() -> None:
    rph = torch.zeros(127, 64)
    qkv = torch.zeros(1, 4096, 3, 2, 64, dtype=torch.bfloat16)
    assert "CUDA" in (gluon_attention_supported(qkv, rph, rph) or "")
    with pytest.raises(ValueError, match="CUDA"):
        launch_gluon_attention(qkv, rph, rph)
    meta = torch.device("meta")
    ok = torch.zeros(1, 4096, 3, 2, 64, dtype=torch.bfloat16, device=meta)
    tables = torch.zeros(127, 64, device=meta)

    def why(qkv: torch.Tensor, rph: torch.Tensor = tables) -> str | None:
        # the device test aside (meta tensors stand for CUDA ones here)
        reason = gluon_attention_supported(qkv, rph, rph)
        return None if reason is not None and "CUDA" in reason else reason

    assert why(ok) is None
    assert "grid" in (why(ok, torch.zeros(27, 64, device=meta)) or "")  # a 14x14 window
    assert "64" in (why(torch.zeros(1, 4096, 3, 2, 80, dtype=torch.bfloat16, device=meta)) or "")
    assert "bf16" in (why(ok.float()) or "")
    assert "contiguous" in (why(ok.expand(2, -1, -1, -1, -1)) or "")  # one image, twice
