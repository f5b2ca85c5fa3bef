"""`SharedStance`: the serving stance holds inside `hold()` only, however holders overlap.

Observed by behaviour: a function compiled for one shape meets a new one, which is a
recompilation under the default stance and an eager run under `eager_on_recompile`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.optimize import SharedStance


def test_the_stance_holds_inside_and_is_put_back(recompile_probe: Callable[[], bool]) -> None:
    stance = SharedStance("eager_on_recompile")
    with stance.hold():
        assert not recompile_probe()
    assert recompile_probe()
    with stance.hold():  # again: the stance can be held more than once in a process
        assert not recompile_probe()
    assert recompile_probe()


def test_what_was_there_before_comes_back(recompile_probe: Callable[[], bool]) -> None:
    torch.compiler.set_stance("fail_on_recompile")  # say, a test's own stance
    with SharedStance("eager_on_recompile").hold():
        assert not recompile_probe()
    with pytest.raises(RuntimeError, match="recompil"):
        recompile_probe()


def test_overlapping_holders_release_in_any_order(recompile_probe: Callable[[], bool]) -> None:
    """Two engines' worker threads: the first to leave does not take the stance from
    the second, and the last puts back the default (nested set_stance would leave it)."""
    stance = SharedStance("eager_on_recompile")
    first, second = stance.hold(), stance.hold()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not recompile_probe()
    second.__exit__(None, None, None)
    assert recompile_probe()
