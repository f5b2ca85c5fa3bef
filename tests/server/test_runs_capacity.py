"""`server.engine.runs.RunsCapacity`: the room a decoder batch's one copy back keeps for its
runs. Too little room costs a second copy (tests/models/test_runs_kernel.py checks the runs
are right either way); too much, a larger copy. These pin how the room follows the batches."""

from __future__ import annotations

import pytest

from server.engine.runs import RunsCapacity


def test_the_room_starts_at_the_floor_and_never_exceeds_the_pixels() -> None:
    capacity = RunsCapacity(floor=1024)
    assert capacity.room(masks=3, pixels=10**7) == 3 * 1024 + 1  # and the sentinel
    assert capacity.room(masks=3, pixels=100) == 101  # every pixel a run, at most


def test_the_room_follows_the_largest_recent_need_with_a_quarter_to_spare() -> None:
    capacity = RunsCapacity(floor=1024, window=4)
    capacity.saw(masks=3, runs=3 * 87_000)  # noise masks: 108,750 a mask with the spare
    assert capacity.room(masks=1, pixels=10**9) == 109_568 + 1  # up to a whole 1,024
    capacity.saw(masks=8, runs=8 * 200)  # smaller needs later do not shrink it at once
    assert capacity.room(masks=2, pixels=10**9) == 2 * 109_568 + 1
    for _ in range(4):  # once the noise batch is out of the window, back to the floor
        capacity.saw(masks=1, runs=300)
    assert capacity.room(masks=2, pixels=10**9) == 2 * 1024 + 1


def test_a_need_just_past_a_whole_1024_takes_the_next() -> None:
    capacity = RunsCapacity(floor=1)
    capacity.saw(masks=1, runs=1639)  # 2,048.75 with the spare
    assert capacity.room(masks=1, pixels=10**9) == 3072 + 1
    capacity.saw(masks=0, runs=0)  # a batch of no masks says nothing
    assert capacity.room(masks=1, pixels=10**9) == 3072 + 1


@pytest.mark.parametrize(("floor", "window"), [(0, 4), (1, 0)])
def test_a_room_of_nothing_is_refused(floor: int, window: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        RunsCapacity(floor=floor, window=window)
