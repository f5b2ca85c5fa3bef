"""Capturing CUDA graphs cheaply, for every graph the service records at start-up."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["capturing", "warm_and_capture"]

T = TypeVar("T")


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, pool: _POOL_HANDLE | None, priority: int | None = None
) -> Iterator[None]:
    """Record `graph` on the current stream, like `torch.cuda.graph` without its cache
    flushes; on a side stream of `priority` if one is given, or where the current stream
    is the default stream (which cannot be captured).

    A graph's kernels keep what the stream they were captured on had, whatever stream
    replays them: its priority (measured: `bench/mps_priority.py`, docs/BENCHMARKS.md
    issue 19: a graph captured on a default-priority side stream loses its stage's) and
    its CUDA green context, the SMs it may use (a graph captured on a side stream made in
    the primary context ran on all 132 SMs when replayed on a green context's stream of
    112; captured on that stream it kept to its SMs: `bench/green_confine.py`). So the
    stage's own stream, current during warm-up (`StageWorkers.on_stream`), is the one
    to capture on.

    `torch.cuda.graph` empties the device and pinned-host caches before every capture so
    that the graph may take freed memory (and, with a flag set, runs a full `gc.collect`);
    capturing thirty-odd buckets in a row then re-allocates the cache thirty-odd times at
    start-up. Our graphs share one pool and the warm-up runs have already sized the cache,
    so the flushes buy nothing here.
    """
    torch.cuda.synchronize()
    current = torch.cuda.current_stream()
    if priority is not None or current == torch.cuda.default_stream(current.device):
        stream = torch.cuda.Stream(priority=current.priority if priority is None else priority)
    else:
        stream = current
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()


def warm_and_capture(
    fn: Callable[[], T],
    pool: _POOL_HANDLE | None,
    warmup_runs: int = 2,
    priority: int | None = None,
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` a few times on a side stream (compiling or tuning what it meets first),
    then capture one more call; the graph and that call's outputs, which every replay
    overwrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_runs):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, pool, priority):
        out = fn()
    return graph, out
