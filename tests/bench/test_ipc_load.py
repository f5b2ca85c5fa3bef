"""bench/ipc_load.py on the CPU: every transport answers every call of a short open-loop
run, large replies and GIL-holding readers included, and a row says so."""

from __future__ import annotations

import time

from bench.ipc_load import MODES, hold_gil, main


def test_every_mode_answers_every_call() -> None:
    rows = main(["--rate", "150", "--seconds", "0.6", "--bytes", "65536", "--work-ms", "0.5",
                 "--clients", "2", "--servers", "2"])  # fmt: skip
    assert [row["mode"] for row in rows] == list(MODES)
    for row in rows:
        assert row["sent"] == row["answered"] == 90
        assert 0 < row["p50 ms"] <= row["p99 ms"] <= row["max ms"]


def test_hold_gil_takes_about_what_it_is_asked() -> None:
    started = time.perf_counter()
    hold_gil(5.0)
    assert 0.005 <= time.perf_counter() - started < 0.5
