"""bench/frontend_cpu.py's `--profile` run end to end: a frontend process profiled from the
bench's signal on, its load, its profile read back and printed by step.

It once waited forever: the frontend gives SIGUSR1 to faulthandler's stack dumps, which
replaced the bench's handler, so the profiler never started and nothing said so."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_profiled_run_prints_each_step_s_share(tmp_path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.frontend_cpu", "--requests", "20", "--rate", "20",
         "--kinds", "healthz", "--profile"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| healthz | 20 |" in out, out[-3000:]  # the measured row
    assert "healthz: " in out and "profiled ms/req" in out, out[-3000:]  # the profile
