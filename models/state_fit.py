"""How a checkpoint's state dict fails to fit a model: the one check every loader shares.

SAM, SAM 2 and Swin each read their own file format, but a wrong file shows the same way
in all of them (tensors of another shape, keys missing or left over, integer tensors), and
a user is best served by one error that lists every kind of problem at once, not the first.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

SHOWN = 5  # keys quoted per kind of problem


def non_tensor_entries(state: dict[Any, Any]) -> list[str]:
    """The keys of a loaded dict that are not a name mapped to a tensor: a file that is a
    pickle of something else, read before any key or shape is compared."""
    return [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)]


def fit_problems(
    model: nn.Module,
    state: dict[str, Tensor],
    config_name: str,
    *,
    keys: str = "keys",
    hint: str = "the model name may be wrong: ",
) -> list[str]:
    """Every kind of mismatch between `state` and `model`'s own state dict, in words (an
    empty list when it fits). `keys` names what the keys are ("image-path keys" where a
    file holds more than the model uses); `hint` leads the question of a shape mismatch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems: list[str] = []
    mismatched = [
        f"{k}: expected {expected[k]}, got {tuple(v.shape)}"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    if mismatched:
        problems.append(
            f"shape mismatch in {len(mismatched)} tensors ({'; '.join(mismatched[:3])}); "
            f"{hint}is this checkpoint for {config_name}?"
        )
    missing = [k for k in expected if k not in state]
    if missing:
        problems.append(f"{len(missing)} missing {keys}, e.g. {missing[:SHOWN]}")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected {keys}, e.g. {unexpected[:SHOWN]}")
    non_float = [k for k, v in state.items() if not v.is_floating_point()]
    if non_float:
        problems.append(f"non-floating-point tensors, e.g. {non_float[:SHOWN]}")
    return problems
