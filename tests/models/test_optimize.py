"""`SharedStance`: the serving stance holds inside `hold()` only, however holders overlap.

Observed by behaviour: a function compiled for one shape meets a new one, which is a
recompilation under the default stance and an eager run under `eager_on_recompile`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.optimize import SharedStance, compile_fn


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


def test_exact_casts_round_fused_intermediates_as_eager_does() -> None:
    """`y = x * 1.001` rounds back to x in bf16 for most x, so eager's `y - x` is zero;
    a fused kernel that keeps y in fp32 returns x / 1000 instead. With `exact_casts` the
    compiled function returns eager's zeros (Swin int8's 87% -> 97% top-1, issue 20)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 1.001
        return (y - x).float()

    x = torch.randn(1024, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    eager = f(x)
    fused = compile_fn(f, "default", dynamic=False)(x)
    exact = compile_fn(f, "default", dynamic=False, exact_casts=True)(x)
    assert not torch.equal(fused, eager)  # the difference the option exists for
    assert torch.equal(exact, eager)
