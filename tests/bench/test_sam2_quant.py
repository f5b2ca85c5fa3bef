"""bench.sam2_quant on the CPU: SAM 2's tiny test model, bf16 and int8 (the Triton kernel in
its CPU path), fidelity rows against fp32 on the committed photos."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import PHOTOS


def test_int8_swaps_the_trunk_and_rows_carry_fidelity() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.sam2_quant", "--device", "cpu", "--sizes", "sam2_test_tiny",
         "--variants", "bf16", "int8", "--no-compile", "--images", str(PHOTOS)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    rows = [line for line in done.stdout.splitlines() if line.startswith("| sam2_test_tiny")]
    assert len(rows) == 2
    bf16, int8 = ([cell.strip() for cell in row.split("|")[1:-1]] for row in rows)
    assert bf16[1:3] == ["bf16", "0"] and int8[1] == "int8" and int(int8[2]) > 10
    for row in (bf16, int8):
        assert 0 < float(row[5]) < 0.1  # embedding error against fp32
        assert float(row[6]) > 0.9  # mean mask IoU
