"""What every loader shares: building a model to be filled, and how a state dict fails to fit.

SAM, SAM 2 and Swin each read their own file format, but a wrong file shows the same way
in all of them (tensors of another shape, keys missing or left over, integer tensors), and
a user is best served by one error that lists every kind of problem at once, not the first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import Tensor, nn

# torch.nn.init's in-place initialisers, which the modules' constructors call
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                 "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_")  # fmt: skip

SHOWN = 5  # keys quoted per kind of problem

M = TypeVar("M", bound=nn.Module)


class _Skipping(threading.local):
    depth = 0


_skipping = _Skipping()
_install_lock = threading.Lock()
_installed: dict[str, Callable[..., Tensor]] = {}
_users = 0


def _unless_unfilled(initialiser: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(initialiser)
    def maybe(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if _skipping.depth:
            return tensor
        return initialiser(tensor, *args, **kwargs)

    return maybe


@contextmanager
def unfilled() -> Iterator[None]:
    """Modules built here, on this thread, get uninitialised memory: no initialiser runs.

    Every loader fills them next (a checkpoint, or seeded random weights), so the
    constructors' initialisers are work thrown away. On the CPU rather than the meta
    device: memory that is never written costs nothing, while computing on meta tensors
    (an initialiser's `normal_`, a buffer's index arithmetic) runs torch's Python
    references, which import torch._dynamo: 7 s on the H100 machine, a third of a warm
    AOT start (issue 21).

    `torch.nn.init` is one module for the whole process, and engines build their models on
    threads of their own (the in-process server's engine thread). So the initialisers are
    replaced by ones that skip only on a thread inside this block, installed by the first
    thread in and restored by the last one out. Swapping them in and out per thread, two
    overlapping threads left the skipping ones installed for good (the second had saved
    the first's as the originals), and every module built later in the process held
    whatever memory it was given: a CI run's Swin test found the freed fp8 weights of an
    earlier test in its new model, and NaNs in its calibration.
    """
    global _users
    with _install_lock:
        if _users == 0:
            for name in _INITIALISERS:
                original = getattr(nn.init, name)
                _installed[name] = original
                setattr(nn.init, name, _unless_unfilled(original))
        _users += 1
    _skipping.depth += 1
    try:
        yield
    finally:
        _skipping.depth -= 1
        with _install_lock:
            _users -= 1
            if _users == 0:
                for name, original in _installed.items():
                    setattr(nn.init, name, original)
                _installed.clear()


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


def adopt(model: M, state: dict[str, Tensor]) -> None:
    """Take a checked state dict's tensors as the model's own (no copy: the file's memory
    map), in fp32."""
    model.load_state_dict(state, strict=True, assign=True)
    model.float()


def ready_for_inference(model: M, label: str) -> M:
    """The filled model in eval mode with gradients off; a tensor no loader filled is a
    bug in the model's module, not in the file, and says which."""
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"{label}: tensors left uninitialised: {leftovers[:SHOWN]}")
    return model.eval().requires_grad_(False)
