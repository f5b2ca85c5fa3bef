"""`SharedStance`: the serving stance holds inside `hold()` only, however holders overlap.

Observed by behaviour: a function compiled for one shape meets a new one, which is a
recompilation under the default stance and an eager run under `eager_on_recompile`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from models.optimize import SharedStance


@pytest.fixture
def probe() -> Iterator[Callable[[], bool]]:
    """Call it: whether a never-seen shape made dynamo compile again."""
    torch._dynamo.reset()
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    add_one = torch.compile(lambda x: x + 1, backend=counting, dynamic=False)
    add_one(torch.zeros(1))
    sizes = iter(range(2, 1000))

    def recompiles() -> bool:
        before = len(graphs)
        add_one(torch.zeros(next(sizes)))
        return len(graphs) > before

    yield recompiles
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def test_the_stance_holds_inside_and_is_put_back(probe: Callable[[], bool]) -> None:
    stance = SharedStance("eager_on_recompile")
    with stance.hold():
        assert not probe()
    assert probe()
    with stance.hold():  # again: the stance can be held more than once in a process
        assert not probe()
    assert probe()


def test_what_was_there_before_comes_back(probe: Callable[[], bool]) -> None:
    torch.compiler.set_stance("fail_on_recompile")  # say, a test's own stance
    with SharedStance("eager_on_recompile").hold():
        assert not probe()
    with pytest.raises(RuntimeError, match="recompil"):
        probe()


def test_overlapping_holders_release_in_any_order(probe: Callable[[], bool]) -> None:
    """Two engines' worker threads: the first to leave does not take the stance from
    the second, and the last puts back the default (nested set_stance would leave it)."""
    stance = SharedStance("eager_on_recompile")
    first, second = stance.hold(), stance.hold()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not probe()
    second.__exit__(None, None, None)
    assert probe()
