"""Running a Triton kernel's test script in Triton's interpreter, for the kernel tests.

CI has no GPU: `TRITON_INTERPRET=1` executes the same kernel source on the CPU. Triton reads
the variable when it is imported, so each script runs in a fresh process, which prints its
results as one JSON list on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(
    script: str, cases: list[Any], timeout: float = 240, interpret: bool = True
) -> list[Any]:
    """`python -c script <cases as JSON>` under the interpreter; one result per case.

    `interpret=False` runs it with Triton as it is (no kernel can run here then): for steps
    that only trace a kernel's launch, such as torch.export, which the interpreter's kernels
    cannot go through."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases), results
    return results


DRIVER = r"""
import contextlib, io, json, sys

results = []
for script, cases in json.loads(sys.stdin.read()):
    sys.argv = ["-c", json.dumps(cases)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, f"<script {len(results)}>", "exec"), {"__name__": "__main__"})
    results.append(json.loads(out.getvalue().strip().splitlines()[-1]))
print(json.dumps(results))
"""


def run_interpreted_together(
    scripts: list[tuple[str, list[Any]]], timeout: float = 600
) -> list[list[Any]]:
    """Several `run_interpreted` scripts, in order, in one interpreted process: each sees
    its cases as `sys.argv[1]` and fresh globals, and its last printed line is its results.
    One start of Python, torch and Triton instead of one per script (seconds each on CI's
    two shared cores); the results are those of `run_interpreted`, script by script."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(scripts),
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(scripts), results
    for (_, cases), result in zip(scripts, results, strict=True):
        assert len(result) == len(cases), result
    return results
