"""The warp-specialised Gluon GEMM (models/gemm_gluon.py) compiled for an H100 (sm_90) by
this machine's Triton: Gluon has no interpreter, so what the CPU can check is what the
kernel compiles to; its numbers are checked on the GPU against the persistent Triton
kernel (bench/gemm_gluon.py, docs/BENCHMARKS.md, issue 20)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.gemm_gluon import CHECKS, FORMS, compile_for_hopper
from bench.gemm_resources import resources, setmaxnreg
from models import gemm_gluon
from models.gemm_gluon import launch_gluon


@pytest.mark.parametrize("form", list(FORMS))
def test_each_served_form_compiles_to_two_consumers_and_a_producer(form: str) -> None:
    """int8 warp-group MMAs fed and drained by TMA, no spills, within 227 KiB of shared
    memory; the consumer warp groups raised to their register budget and the producer
    warp lowered to its own (`setmaxnreg`), which is what lets two 128x128 int32
    accumulators live on one SM."""
    compiled = compile_for_hopper(form)
    ptx = compiled.asm["ptx"]
    found = resources(compiled)
    assert found["wgmma"] == "m64n128k32.s32.s8.s8", found
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    regs = {str(n) for _, n in setmaxnreg(ptx)}
    config = gemm_gluon.GluonConfig()
    assert {str(config.consumer_registers), str(gemm_gluon.PRODUCER_REGISTERS)} <= regs, regs
    residual, gelu = FORMS[form].residual, FORMS[form].gelu
    assert ("tanh.approx.f32" in ptx) == (gelu == 2)
    # TMA loads completing on an mbarrier: both operands, and the residual's tile into the
    # output's staging buffer; the output leaves by a TMA store
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx))
    assert loads == (4 if residual else 2), loads  # the residual: once in each consumer
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::\w+\.bulk_group", ptx)
    # each consumer waits for its turn, for its ring slots and (with a residual) for the
    # residual's tile; the producer for emptied slots. Each consumer frees slots (twice in
    # its code) and hands the turn over: without the turns a group could pass a slot's
    # parity wait two phases early (models/gemm_gluon.py, `_ws_consumer`)
    waits = len(re.findall(r"mbarrier\.try_wait\.parity", ptx))
    assert waits == 2 * (3 if residual else 2) + 1, waits
    assert len(re.findall(r"mbarrier\.arrive\.shared", ptx)) == 2 * 3


def test_the_launch_refuses_what_it_cannot_run() -> None:
    xq = torch.zeros(256, 768, dtype=torch.int8)
    w = torch.zeros(768, 768, dtype=torch.int8)
    with pytest.raises(ValueError, match="CUDA"):
        launch_gluon(xq, torch.ones(256), w, torch.ones(768))
    with pytest.raises(ValueError, match="Gluon GEMM"):  # rows of 24 bytes: not for TMA
        launch_gluon(xq[:, :24], torch.ones(256), w[:, :24], torch.ones(768))


def test_the_gpu_checks_cover_every_form_with_a_partial_last_tile() -> None:
    """What bench/gemm_gluon.py checks against torch before timing anything on the GPU:
    each served form once, on rows that leave the last 128-row tile partly empty (TMA's
    zero fill on load and clipping on store)."""
    assert {form for *_, form in CHECKS} == set(FORMS)
    assert all(m % 128 for m, *_ in CHECKS)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_cooperative_form_shares_each_tile_between_both_groups(form: str) -> None:
    """`GluonConfig.coop`: both consumer groups on one 128 x 256 tile, each its half of the
    columns, so the ring's slots hold 256 rows of B and 3 of them fit beside the output's
    staging. No turns are handed over (each group waits for its slots, its residual, and
    nothing else), and a slot is emptied by both groups' arrivals."""
    config = gemm_gluon.COOP_PLAIN
    compiled = compile_for_hopper(form, config)
    ptx = compiled.asm["ptx"]
    found = resources(compiled)
    assert found["wgmma"] == "m64n128k32.s32.s8.s8", found
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    out_bytes = 1 if FORMS[form].int8_out else 2
    ring = config.stages * (config.block_m + 2 * config.block_n) * config.block_k
    staging = 2 * config.block_m * config.block_n * out_bytes
    assert ring + staging <= compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    residual = FORMS[form].residual
    waits = len(re.findall(r"mbarrier\.try_wait\.parity", ptx))
    assert waits == 2 * (2 if residual else 1) + 1, waits  # slots (and residual); producer
    # each group frees slots (twice in its code); no turn is handed over
    assert len(re.findall(r"mbarrier\.arrive\.shared", ptx)) == 2 * 2
    # the two slots of emptied counted twice: `mbarrier.init` with a count of 2
    assert re.search(r"mbarrier\.init\.shared(::cta)?\.b64 \[[^]]+\], 2;", ptx)


def test_the_plain_products_take_the_cooperative_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config `launch_gluon` runs without one: `COOP_PLAIN` for a float output with
    neither residual nor GELU and N a multiple of 256 (SAM's qkv), the ping-pong default for
    the rest (measured slower on the cooperative tiles), and for every product with
    `COOPERATIVE` off."""
    default = gemm_gluon.GluonConfig()
    cases = [
        ((False, False, False, 2304), gemm_gluon.COOP_PLAIN),  # qkv
        ((True, False, False, 768), default),  # proj, lin2: a residual
        ((False, True, True, 3072), default),  # lin1: GELU, int8 out
        ((False, False, False, 288), default),  # Swin-T's first qkv: N not a multiple of 256
        ((False, False, False, 2304, True), default),  # e4m3: not run cooperatively on a GPU
    ]
    for args, want in cases:
        assert gemm_gluon.served_config(*args) == want, args
    monkeypatch.setattr(gemm_gluon, "COOPERATIVE", False)
    assert gemm_gluon.served_config(False, False, False, 2304) == default
