"""bench/sam2_upscale.py's CPU smoke: the unfused step is timed in each precision (the
kernel's rows need CUDA or the interpreter: tests/models/test_sam2_upscale_kernel.py)."""

from __future__ import annotations

from bench.sam2_upscale import main


def test_cpu_smoke_times_the_unfused_step() -> None:
    argv = ["--device", "cpu", "--prompts", "2", "--points", "4", "--side", "4", "--iters", "1"]
    rows = main([*argv, "--no-compile", "--dtypes", "fp32", "bf16"])
    assert [(r["dtype"], r["variant"]) for r in rows] == [("fp32", "eager"), ("bf16", "eager")]
    assert all(r["ms_per_call"] > 0 and r["ms_per_photo"] == 2 * r["ms_per_call"] for r in rows)
