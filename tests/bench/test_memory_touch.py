"""bench.memory_touch runs here as on the GPU machine and prints one row a pass."""

from __future__ import annotations

import pytest

from bench import memory_touch


def test_prints_one_row_a_pass(capsys: pytest.CaptureFixture[str]) -> None:
    memory_touch.main(["--gib", "0.01", "--passes", "3"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| pass |")
    passes = [r.strip("| ").split(" | ") for r in rows[1:] if not r.startswith("|---")]
    assert [p[0] for p in passes] == ["1", "2", "3"]
    for _, gib, seconds, rate, per_page, handed in passes:
        assert float(gib) == 0.01
        assert float(seconds) > 0 and float(rate) > 0 and float(per_page) > 0
        # MiB the guest handed back meanwhile, or "-" where the kernel keeps no count
        assert handed == "-" or float(handed) >= 0


def test_less_than_a_page_maps_one() -> None:
    # less than a page still maps (and touches) one
    assert memory_touch.touch(1e-9) > 0
