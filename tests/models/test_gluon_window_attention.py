"""The warp-specialised Gluon window attention (models/sam/gluon_window_attention.py).

Gluon has no interpreter, so the CPU checks two things: the kernel's arithmetic, written
out in torch exactly as the kernel arranges it (the 16 x 16 box, the scores' extra
columns from the tables and the constant tile, the padded keys' share from the terms
alone), against Meta's padded and partitioned windows; and what the kernel compiles to
for an H100 (sm_90). Its numbers are checked on the GPU against the Triton kernel
(bench/gluon_window_attention.py, docs/BENCHMARKS.md, issue 20).
"""

from __future__ import annotations

import re

import pytest
import torch

from bench.gluon_window_attention import compile_for_hopper, dense_reference
from models.sam import gluon_window_attention as gw
from models.sam.gluon_window_attention import (
    BK_ROW,
    BOX,
    HEAD_DIM,
    LOG2E,
    TABLE,
    WINDOW,
    gluon_window_supported,
    launch_gluon_window_attention,
    window_constants,
    window_tables,
)

HEADS = 2
GRID = 64  # 5 x 5 windows, the last row and column of windows padded (8 real of 14)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, GRID * GRID, 3, HEADS, HEAD_DIM, generator=g)
    rph = torch.randn(2 * WINDOW - 1, HEAD_DIM, generator=g) * 0.2
    rpw = torch.randn(2 * WINDOW - 1, HEAD_DIM, generator=g) * 0.2
    bias = torch.randn(3 * HEADS * HEAD_DIM, generator=g) * 0.5
    return tuple(t.to(torch.bfloat16) for t in (qkv, rph, rpw, bias))


def kernel_arithmetic(
    qkv: torch.Tensor, rph: torch.Tensor, rpw: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The kernel's arithmetic in torch (fp32 sums of bf16 operands, as wgmma does), one
    window and head at a time: what each consumer computes for its tiles, all 256 query
    slots of the box at once."""
    B, N, _, heads, C = qkv.shape
    side = GRID
    n = -(-side // WINDOW)
    pad = side - (n - 1) * WINDOW
    tables = window_tables(rph, rpw, bias.view(3, -1)[1], heads, qkv.dtype).float()
    const = window_constants(pad, pad, qkv.device, qkv.dtype).float().view(2, BOX * BOX, -1)
    scale = C**-0.5 * LOG2E
    grid = qkv.float().view(B, side, side, 3, heads, C)
    out = torch.zeros(B, side, side, heads, C)
    slot = torch.arange(BOX * BOX)
    qy, qx = slot // BOX, slot % BOX
    j = torch.arange(16)
    b_v = bias.view(3, heads, C)[2].float()
    for wy in range(n):
        for wx in range(n):
            # TMA's box: the tokens at the window's corner, zeros past the image
            box = torch.zeros(B, BOX, BOX, 3, heads, C)
            ys, xs = wy * WINDOW, wx * WINDOW
            ye, xe = min(ys + BOX, side), min(xs + BOX, side)
            box[:, : ye - ys, : xe - xs] = grid[:, ys:ye, xs:xe]
            box = box.view(B, BOX * BOX, 3, heads, C)
            f_r = float(xs + WINDOW > side)
            f_b = float(ys + WINDOW > side)
            for h in range(heads):
                q, k, v = box[:, :, 0, h], box[:, :, 1, h], box[:, :, 2, h]
                t_h = tables[(2 * h) * TABLE : (2 * h + 1) * TABLE]
                t_w = tables[(2 * h + 1) * TABLE : (2 * h + 2) * TABLE]
                u_h, u_w = q @ t_h.T, q @ t_w.T  # [B, 256, 32]
                idx_h = torch.where(j < WINDOW, qy[:, None] - j + WINDOW - 1, BK_ROW)
                idx_w = torch.where(j < WINDOW, qx[:, None] - j + WINDOW - 1, BK_ROW)
                fac_h = torch.where(j < WINDOW, C**0.5, torch.where(j == WINDOW, f_r, f_b))
                fac_w = torch.where(j < WINDOW, C**0.5,
                                    torch.where(j == WINDOW, -f_r * f_b, 0.0))  # fmt: skip
                big = torch.where(j == WINDOW + 1, -30000.0, 0.0)
                x_h = (torch.gather(u_h, 2, idx_h.expand(B, -1, -1)) * fac_h).bfloat16().float()
                x_w = torch.gather(u_w, 2, idx_w.expand(B, -1, -1)) * fac_w + big
                x_w = x_w.bfloat16().float()
                s = q @ k.transpose(1, 2) + x_h @ const[0].T + x_w @ const[1].T
                m = s.amax(-1, keepdim=True) * scale
                p = torch.exp2(s * scale - m)
                acc = p.bfloat16().float() @ v
                # the padded keys' share of p, from the terms alone, as the kernel takes it
                eh = torch.where(j < WINDOW, x_h * scale, float("-inf"))
                ew = torch.where(j < WINDOW, x_w * scale, float("-inf"))
                a_h, a_w = eh.amax(-1, keepdim=True), ew.amax(-1, keepdim=True)
                eh, ew = torch.exp2(eh - a_h), torch.exp2(ew - a_w)
                h_all, w_all = eh.sum(-1), ew.sum(-1)
                h_pad = torch.where(j >= pad, eh, 0.0).sum(-1)
                w_pad = torch.where(j >= pad, ew, 0.0).sum(-1)
                qbk = torch.gather(u_h, 2, torch.full_like(idx_h[:, :1], BK_ROW).expand(B, -1, 1))
                qbk = qbk.bfloat16().float()[..., 0]
                pad_sum = f_r * h_all * w_pad + f_b * h_pad * w_all - f_r * f_b * h_pad * w_pad
                pad_p = pad_sum * torch.exp2(qbk * scale + a_h[..., 0] + a_w[..., 0] - m[..., 0])
                res = (acc + pad_p[..., None] * b_v[h]) / p.sum(-1, keepdim=True)
                res = res.view(B, BOX, BOX, C)[:, :WINDOW, :WINDOW]
                ye, xe = min(ys + WINDOW, side), min(xs + WINDOW, side)
                out[:, ys:ye, xs:xe, h] = res[:, : ye - ys, : xe - xs]
    return out.view(B, N, heads * C)


def test_the_kernels_arithmetic_is_metas_padded_windows() -> None:
    qkv, rph, rpw, bias = _inputs(0)
    ref = dense_reference(qkv, rph, rpw, bias, heads=HEADS)
    got = kernel_arithmetic(qkv, rph, rpw, bias)
    err = (got - ref).abs().max() / ref.abs().max()
    # bf16's rounding of p and of the terms: the Triton kernel's own error is of this size
    assert err < 0.01, err
    # the windows past the edge (their padded keys carry qkv's bias) as close as the rest
    edge = (got - ref).view(GRID, GRID, -1)[56:, :].abs().max() / ref.abs().max()
    assert edge < 0.01, edge


def test_the_constant_tile_marks_each_key_slot() -> None:
    c = window_constants(8, 8, torch.device("cpu"), torch.float32).view(2, BOX * BOX, -1)
    slot = torch.arange(BOX * BOX)
    ky, kx = slot // BOX, slot % BOX
    inside = (ky < WINDOW) & (kx < WINDOW)
    # one row and one column a key of the window, nothing for the neighbours' slots
    assert torch.equal(c[0, :, :WINDOW].sum(1), inside.float())
    assert torch.equal(c[1, :, :WINDOW].sum(1), inside.float())
    assert torch.equal(c[1, :, WINDOW + 1], (~inside).float())
    assert int(c[0, :, WINDOW].sum()) == 14 * 6  # right edge: x 8..13 of every row
    assert int(c[1, :, WINDOW].sum()) == 6 * 6  # the corner


def test_it_compiles_to_a_producer_and_two_consumers() -> None:
    compiled = compile_for_hopper()
    ptx = compiled.asm["ptx"]
    from bench.gemm_resources import resources, setmaxnreg

    found = resources(compiled)
    # the tables' products 32 wide, the scores 128 (half the box's slots), p . v 64
    assert found["wgmma"] == (
        "m64n128k16.f32.bf16.bf16 m64n32k16.f32.bf16.bf16 m64n64k16.f32.bf16.bf16"
    ), found
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    # nothing spilled: the products' descriptors are made next to them, each tile (hoisted
    # out of the tile loop they took 352 bytes of stack under Triton 3.6, 0.242 against
    # 0.173-0.177 ms a layer on an H100)
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    # ... made from the buffer index through one opaque move, once a tile of each consumer
    assert len(re.findall(r"mov\.b32 %r\d+, %r\d+;\s*// end inline asm", ptx)) >= 2
    regs = {n for _, n in setmaxnreg(ptx)}
    assert {gw.CONSUMER_REGISTERS, gw.PRODUCER_REGISTERS} <= regs
    # TMA: the two constant tiles once; a job's keys, values, two tables and queries
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::\w+\.global\.mbarrier", ptx)
    assert sorted(loads) == ["2", "2", "2", "2", "4", "4", "4"], loads
    # an exponential a score: a thread holds 64 of each half's [64, 128] scores, two halves
    # a tile, in each of the two consumers (and a few more: the rescale, the padding terms)
    assert len(re.findall(r"ex2\.approx", ptx)) >= 2 * 2 * 64


def test_its_output_can_leave_int8_for_the_projection() -> None:
    """`out_inv_scale`: the output rows stored as int8 by the head's fixed inverse scales
    (models.triton_quant's rounding), nothing spilled."""
    from bench.gemm_resources import resources

    compiled = compile_for_hopper(quant_out=True)
    ptx = compiled.asm["ptx"]
    found = resources(compiled)
    assert found["stack_bytes"] == 0 and found["local_bytes"] == 0, found
    # two neighbouring columns a store: int8 pairs (b16) where bf16 ones were b32
    assert set(re.findall(r"st\.global[.\w]*", ptx)) == {"st.global.b16"}
    plain = compile_for_hopper().asm["ptx"]
    assert set(re.findall(r"st\.global[.\w]*", plain)) == {"st.global.b32"}


def test_only_the_layers_it_was_written_for_are_taken() -> None:
    rph = torch.zeros(27, 64)
    meta = torch.device("meta")
    ok = torch.zeros(1, 4096, 3, 2, 64, dtype=torch.bfloat16, device=meta)
    tables = torch.zeros(27, 64, device=meta)

    def why(qkv: torch.Tensor, rph: torch.Tensor = tables, side: int = 64) -> str | None:
        reason = gluon_window_supported(qkv, rph, rph, side, side)
        return None if reason is not None and "CUDA" in reason else reason

    assert why(ok) is None
    assert "14" in (why(ok, torch.zeros(127, 64, device=meta)) or "")  # a global block
    assert "grid" in (why(ok, side=32) or "")
    assert "bf16" in (why(ok.float()) or "")
    assert "contiguous" in (why(ok.expand(2, -1, -1, -1, -1)) or "")
    cpu = torch.zeros(1, 4096, 3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        launch_gluon_window_attention(cpu, rph, rph, None, 64, 64)


def test_a_layers_tables_are_built_once_and_again_after_the_weights_change() -> None:
    _, rph, rpw, bias = _inputs(1)
    bias_k = bias.view(3, -1)[1]
    first = gw._layer_tables(rph, rpw, bias_k, HEADS, torch.bfloat16)
    assert gw._layer_tables(rph, rpw, bias_k, HEADS, torch.bfloat16) is first
    assert torch.equal(first, window_tables(rph, rpw, bias_k, HEADS, torch.bfloat16))
    with torch.no_grad():
        rph.add_(1.0)  # new weights in place: the tables follow
    again = gw._layer_tables(rph, rpw, bias_k, HEADS, torch.bfloat16)
    assert again is not first
    assert torch.equal(again, window_tables(rph, rpw, bias_k, HEADS, torch.bfloat16))
