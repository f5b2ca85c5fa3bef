"""`models.state_fit.unfilled` skips torch's initialisers only on the thread that asked."""

from __future__ import annotations

import threading

import torch
from torch import nn

from models.state_fit import unfilled

SENTINEL = 7.0


def _initialised(layer: nn.Linear) -> bool:
    """kaiming_uniform_ keeps a Linear's weights within 1/sqrt(fan_in); a skipped one keeps
    the sentinel it was filled with."""
    return bool((layer.weight.abs() <= 1 / layer.in_features**0.5 + 1e-6).all())


def _linear_on(fill: float = SENTINEL) -> nn.Linear:
    with torch.no_grad():
        layer = nn.Linear(16, 8)
        layer.weight.fill_(fill)
        layer.reset_parameters()
    return layer


def test_a_module_built_inside_is_left_unfilled_and_the_initialisers_return() -> None:
    original = nn.init.kaiming_uniform_
    with unfilled():
        assert not _initialised(_linear_on())
    assert nn.init.kaiming_uniform_ is original
    assert _initialised(_linear_on())


def test_another_thread_inside_does_not_skip_this_threads_initialisers() -> None:
    inside, leave = threading.Event(), threading.Event()
    skipped: list[bool] = []

    def loader() -> None:
        with unfilled():
            inside.set()
            leave.wait(10)
            skipped.append(not _initialised(_linear_on()))

    thread = threading.Thread(target=loader)
    thread.start()
    assert inside.wait(10)
    try:
        assert _initialised(_linear_on())  # this thread is not building a model to fill
    finally:
        leave.set()
        thread.join(10)
    assert skipped == [True]


def test_overlapping_threads_leave_the_real_initialisers_behind() -> None:
    """Thread A in, thread B in, A out, B out: the order that, with the initialisers
    swapped per thread, left the skipping ones installed for the rest of the process."""
    original = nn.init.kaiming_uniform_
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with unfilled():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with unfilled():
            b_in.set()
            a_out.wait(10)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert a_out.is_set() and b_in.is_set()
    assert nn.init.kaiming_uniform_ is original
    assert _initialised(_linear_on())
