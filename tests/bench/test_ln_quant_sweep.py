"""bench.ln_quant_sweep's rows on the CPU (the norm's torch reference): the served shape
first, each shape's packed rows compared with it, and the shape put back after."""

from __future__ import annotations

from bench.ln_quant_sweep import sweep
from models import ln_quant


def test_the_sweep_times_each_shape_once_served_first_and_puts_the_shape_back() -> None:
    served = ln_quant.launch_shape(64)  # C = 64: 16 rows of 64 slots, 4 warps
    rows = sweep(24, 64, [(1, 1), served, (2, 2)], reps=1, iters=1)
    assert [(r["rows"], r["warps"]) for r in rows] == [served, (1, 1), (2, 2)]
    assert [r["served"] for r in rows] == [True, False, False]
    for r in rows:
        assert r["us"] > 0 and r["gb_per_s"] > 0, r
        assert r["mismatch"] == 0 and r["max_step"] == 0, r  # one norm, one reference
    assert ln_quant.SHAPE is None
