"""bench/click_pace.py's pacing and clock sampling, without a GPU (the CPU's host clock)."""

from __future__ import annotations

import itertools
import time

from bench.click_pace import ClockSampler, paced


def test_paced_calls_keep_their_period_and_back_to_back_calls_do_not_wait() -> None:
    calls: list[float] = []
    row = paced(lambda: calls.append(time.perf_counter()), 5.0, 0.2, gpu=False)
    assert 30 <= row["calls"] <= 41, row  # 0.2 s at one call per 5 ms
    gaps = sorted(b - a for a, b in itertools.pairwise(calls))
    # asleep between calls, not back to back (a late call goes at once, open loop, so on a
    # loaded machine a few gaps are short: the median holds the period)
    assert 0.004 < gaps[len(gaps) // 2] < 0.006, gaps
    assert set(row) == {"calls", "wall_p50", "wall_p99"}
    spun = paced(lambda: None, 5.0, 0.1, gpu=False, idle="spin")
    assert 15 <= spun["calls"] <= 21, spun
    fast = paced(lambda: None, 0.0, 0.05, gpu=False)
    assert fast["calls"] > 200 and fast["wall_p50"] < 1.0, fast


def test_clock_sampler_reports_nothing_without_nvidia_smi(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    sampler = ClockSampler()
    sampler.start()
    assert sampler.stop() == {}
