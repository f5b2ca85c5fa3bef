"""`server.engine.runs.RunsCapacity`: the room a decoder batch's one copy back keeps for its
runs. Too little room costs a second copy (tests/models/test_runs_kernel.py checks the runs
are right either way); too much, a larger copy. These pin how the room follows the batches."""

from __future__ import annotations

import pytest

from server.engine.runs import RunsCapacity

SMALL = 800 * 534  # pixels of the smallest test photo
LARGE = 1920 * 1920  # and of the largest


def test_the_room_starts_at_the_floor_and_never_exceeds_the_pixels() -> None:
    capacity = RunsCapacity(floor=1024)
    assert capacity.room(masks=3, pixels=3 * SMALL) == 3 * 1024 + 1  # and the sentinel
    assert capacity.room(masks=3, pixels=100) == 101  # every pixel a run, at most


def test_the_room_follows_the_pixels_not_the_largest_mask() -> None:
    """Noise masks (a run in five pixels) on a large photo must not give a click on a small
    one the large photo's room: that copied up to 8.6 times the bytes needed."""
    capacity = RunsCapacity(floor=1024)
    capacity.saw(pixels=3 * LARGE, runs=3 * LARGE // 5)
    small_need = 3 * SMALL // 5
    room = capacity.room(masks=3, pixels=3 * SMALL)
    assert small_need < room <= small_need * 1.25 + 1024 + 1  # a quarter to spare, at most
    assert room % 1024 == 1  # whole 1,024s and the sentinel
    assert capacity.room(masks=3, pixels=3 * LARGE) > 3 * LARGE // 5


def test_the_densest_recent_batch_sets_the_room_until_it_leaves_the_window() -> None:
    capacity = RunsCapacity(floor=1024, window=4)
    capacity.saw(pixels=SMALL, runs=SMALL // 5)  # noise
    capacity.saw(pixels=SMALL, runs=900)  # a real mask's outline: does not shrink it at once
    assert capacity.room(masks=1, pixels=SMALL) > SMALL // 5
    for _ in range(4):  # once the noise batch is out of the window, the outlines' room:
        capacity.saw(pixels=SMALL, runs=900)
    assert capacity.room(masks=2, pixels=2 * SMALL) == 3 * 1024 + 1  # 1,800 and a quarter
    assert capacity.room(masks=4, pixels=2 * SMALL) == 4 * 1024 + 1  # the floor, 1,024 a mask
    capacity.saw(pixels=0, runs=0)  # a batch of no masks says nothing
    assert capacity.room(masks=2, pixels=2 * SMALL) == 3 * 1024 + 1


@pytest.mark.parametrize(("floor", "window"), [(0, 4), (1, 0)])
def test_a_room_of_nothing_is_refused(floor: int, window: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        RunsCapacity(floor=floor, window=window)


def test_the_characters_room_follows_the_most_characters_a_run_recently() -> None:
    """COCO strings written on the device: the first copy keeps room for as many
    characters a run as the recent batches had, a quarter to spare (a second copy brings
    any more; tests/models/test_runs_kernel.py checks the strings either way)."""
    capacity = RunsCapacity(window=2)
    assert capacity.chars(runs=10_000) == 25 * 1024  # two a run before any batch, and a quarter
    capacity.saw(pixels=SMALL, runs=SMALL // 5, chars=SMALL // 5)  # noise: one a run
    assert capacity.chars(runs=10_000) == 13 * 1024  # 12,500 rounded up to 1,024s
    capacity.saw(pixels=SMALL, runs=1_000, chars=3_000)  # an outline's long runs: three
    assert capacity.chars(runs=10_000) == 37 * 1024
    capacity.saw(pixels=SMALL, runs=SMALL // 5)  # runs with no strings leave the room
    assert capacity.chars(runs=10_000) == 37 * 1024
    assert capacity.chars(runs=0) == 0
