"""bench/ipc_roundtrip.py on the CPU: each transport's echo server answers every call, in
its own process, and the rows say how long the round trips took."""

from __future__ import annotations

from bench.ipc_roundtrip import MODES, measure, table


def test_each_transport_answers_every_call_and_its_rows_are_ordered() -> None:
    rows = measure(list(MODES), calls=30, gaps_ms=[1.0, 0.0], size=65_536)
    assert [(r.mode, r.gap_ms) for r in rows] == [
        ("zmq", 1.0), ("zmq", 0.0), ("unix", 1.0), ("unix", 0.0)
    ]  # fmt: skip
    for row in rows:
        assert row.calls == 30
        assert 0 < row.p50_us <= row.p90_us <= row.p99_us < 1_000_000
    text = table(rows)
    assert text.splitlines()[0].startswith("| transport | gap ms |")
    assert len(text.splitlines()) == 2 + len(rows)
