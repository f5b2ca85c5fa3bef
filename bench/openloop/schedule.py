"""Poisson arrivals and the dispatcher that sends each request at its scheduled time.

Nothing here knows HTTP: the dispatcher calls a `Sender` (kind, sequence number) ->
`Outcome`, so the scheduling arithmetic is tested with fake senders that stall.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Arrival = tuple[float, str]  # (seconds after the step's start, kind)


class Outcome(NamedTuple):
    status: str  # "200", "429", ..., "timeout", "conn_error"
    nbytes: int  # response body bytes (0 without a response)
    sent: float  # loop time at which it went out on a connection; NaN: it never did
    timing_ms: dict[str, float] | None = None  # the response's own, where it had one


Sender = Callable[[str, int], Awaitable[Outcome]]  # (kind, seq) -> what became of it


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as it went. `latency_s` counts from the scheduled time, so any wait in
    the client is part of it, as a user would feel it; `lag_s` is that wait alone: from the
    scheduled time until the request went out on a connection (a busy event loop, no free
    connection), or until it was given up if it never did."""

    kind: str
    scheduled_s: float  # seconds after the step's start
    latency_s: float  # completion - scheduled time
    lag_s: float  # went out on a connection (or was given up) - scheduled time
    status: str  # "200", "429", ..., "timeout", "conn_error"
    nbytes: int  # response body bytes (0 without a response)
    timing_ms: dict[str, float] | None = None  # the server's, from the response (phases.py)

    @property
    def completed_s(self) -> float:
        return self.scheduled_s + self.latency_s


def poisson_schedule(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival offsets in [0, seconds) of a Poisson process of `rate` per second
    (exponential gaps); an empty schedule for a rate of 0."""
    if rate < 0 or seconds < 0:
        raise ValueError(f"rate and seconds must be >= 0, not {rate}, {seconds}")
    out: list[float] = []
    if rate == 0:
        return out
    t = rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def arrivals(
    rates: Mapping[str, float], seconds: float, rng_for: Callable[[str], random.Random]
) -> list[Arrival]:
    """One schedule per kind (each from its own seeded generator, so adding a kind to a mix
    leaves the others' schedules as they were), merged in time order."""
    merged = [(t, kind) for kind, rate in rates.items() for t in poisson_schedule(
        rate, seconds, rng_for(kind))]  # fmt: skip
    merged.sort()
    return merged


async def run_open_loop(
    schedule: Sequence[Arrival], send: Sender, start: float, spin_s: float = 0.0
) -> list[Sample]:
    """Fire each arrival at `start + offset` (the running loop's clock, time.monotonic on
    Linux) without waiting for earlier ones, then wait for all of them.

    An arrival whose time has passed (the loop was busy, or started late) is sent at once;
    its latency still counts from its scheduled time. A sender that raises is counted by the
    exception's type, never lost.

    `spin_s`: the loop sleeps until this long before each arrival, then yields to its other
    work until the instant comes. asyncio's sleep wakes through epoll, whose timeout is in
    whole milliseconds rounded up, so without it a request leaves up to a millisecond
    late (about 1 ms at the median on the development machine), which every latency then
    holds: for a target of a few milliseconds, that is the client's error, not the
    service's. The busy wait costs the load process CPU, so it is a choice.
    """
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []

    async def one(seq: int, kind: str, due: float) -> None:
        try:
            outcome = await send(kind, seq)
        except Exception as exc:  # a bug in a sender must show in the counts, not vanish
            outcome = Outcome(f"error:{type(exc).__name__}", 0, math.nan)
        done = loop.time()
        went = done if math.isnan(outcome.sent) else outcome.sent
        samples.append(
            Sample(kind, due - start, done - due, went - due, outcome.status, outcome.nbytes,
                   outcome.timing_ms)
        )  # fmt: skip

    tasks: list[asyncio.Task[None]] = []
    for seq, (offset, kind) in enumerate(schedule):
        due = start + offset
        delay = due - loop.time()
        if delay > spin_s:
            await asyncio.sleep(delay - spin_s)
        while spin_s and loop.time() < due:
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(one(seq, kind, due)))
    await asyncio.gather(*tasks)
    samples.sort(key=lambda s: s.scheduled_s)
    return samples
