"""An asyncio dynamic batcher: one per model stage.

Handlers only enqueue and await; a collector task groups what is waiting into a batch,
hands the batch to the one GPU worker thread, and resolves each item's future with its own
result. Items whose caller has gone (deadline passed, client disconnected) are dropped
before the batch runs, so abandoned work is never computed.

When a batch goes: at once when the worker is idle (waiting then would only add latency:
nothing else could use the GPU meanwhile), else when the worker's running batch ends, the
batch is full (cost or memory), or the oldest item has waited `max_delay_s`. So a lone
request never waits for company, and under load the items that arrive while one batch
computes ride together in the next. Every stage sharing the worker shares one `WorkerLoad`,
so a running encoder batch also makes the decoder's queue collect.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from server.errors import ServiceError
from server.observers import BatchObserver

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

# A batch function maps items to results one-to-one; an exception in place of a result
# fails that item alone, an exception raised fails the whole batch.
BatchFn = Callable[[list[Item]], Sequence[Result | BaseException]]

# The reason a caller gives when it cancels `submit` because its own deadline passed (a
# shared computation that outlived every waiter): counted as "deadline", not "cancelled".
DEADLINE_CANCEL = "deadline"

# Weight of the newest batch in the running mean of a batch's duration (admission control).
_RATE_WEIGHT = 0.3


class WorkerLoad:
    """The batches running (or queued) on one worker executor, shared by its batchers.

    Lives on the event loop: only the batchers' collectors touch it, between awaits. When
    the last batch ends, every batcher waiting for the worker to go idle is woken (its own
    wake-up event), so its queue is dispatched with no further delay.
    """

    def __init__(self) -> None:
        self.running = 0
        self._listeners: list[asyncio.Event] = []

    @classmethod
    def of(cls, executor: Executor) -> WorkerLoad:
        """The one load of `executor`: what its batchers share, made on first asking."""
        load = _LOADS.get(executor)
        if load is None:
            load = _LOADS[executor] = cls()
        return load

    @property
    def busy(self) -> bool:
        """True while any batch of any stage sharing the worker is submitted and unfinished."""
        return self.running > 0

    def listen(self, wakeup: asyncio.Event) -> None:
        """Set `wakeup` whenever the worker goes idle."""
        self._listeners.append(wakeup)

    def started(self) -> None:
        self.running += 1

    def finished(self) -> None:
        self.running -= 1
        if self.running == 0:
            for wakeup in self._listeners:
                wakeup.set()


# one load per executor, gone with it
_LOADS: weakref.WeakKeyDictionary[Executor, WorkerLoad] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class _Entry(Generic[Item, Result]):
    item: Item
    cost: int
    memory: int
    future: asyncio.Future[Result]
    enqueued: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    started: float | None = None  # when its batch began to run


class _Waiting(Generic[Item, Result]):
    """The queue of a stage, with its items' total cost and memory kept as it changes.

    Every submit asks for the cost queued ahead (admission) and every round whether a batch
    is full; summing the queue for each made a submit O(queue): 17% of the engine's event
    loop under a classify overload (py-spy, `python -m bench.engine_loop`).
    """

    def __init__(self, entries: Iterable[_Entry[Item, Result]] = ()) -> None:
        self._entries: collections.deque[_Entry[Item, Result]] = collections.deque()
        self.cost = 0
        self.memory = 0
        for entry in entries:
            self.append(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[_Entry[Item, Result]]:
        return iter(self._entries)

    def first(self) -> _Entry[Item, Result]:
        return self._entries[0]

    def append(self, entry: _Entry[Item, Result]) -> None:
        self._entries.append(entry)
        self.cost += entry.cost
        self.memory += entry.memory

    def popleft(self) -> _Entry[Item, Result]:
        entry = self._entries.popleft()
        self.cost -= entry.cost
        self.memory -= entry.memory
        return entry

    def remove(self, entry: _Entry[Item, Result]) -> None:
        """Take `entry` out (ValueError when it is not here)."""
        self._entries.remove(entry)
        self.cost -= entry.cost
        self.memory -= entry.memory

    def put_back(self, batch: list[_Entry[Item, Result]]) -> None:
        """Return a batch taken but not run to the head of the queue, in its order."""
        self._entries.extendleft(reversed(batch))
        self.cost += sum(entry.cost for entry in batch)
        self.memory += sum(entry.memory for entry in batch)


class GuardedObserver(BatchObserver):
    """An observer whose failures are logged, never raised into the batcher.

    The hooks run inside the collector's loop: one raising there (a metrics file that
    cannot grow, say) ended the loop, and the stage then took no batch again while its
    queue filled and every request behind it timed out, with nothing in the log.
    """

    def __init__(self, inner: BatchObserver) -> None:
        self.inner = inner
        self._failed: set[str] = set()

    def _call(self, hook: str, *args: object) -> None:
        try:
            getattr(self.inner, hook)(*args)
        except Exception:
            if hook not in self._failed:  # once per hook: it may fail on every batch
                self._failed.add(hook)
                log.exception("batch observer's %s failed (metrics may be incomplete)", hook)

    def declare(self, stage: str) -> None:
        self._call("declare", stage)

    def queue_depth(self, stage: str, depth: int) -> None:
        self._call("queue_depth", stage, depth)

    def batch_started(self, stage: str, size: int, cost: int, waits_s: Sequence[float]) -> None:
        self._call("batch_started", stage, size, cost, waits_s)

    def batch_finished(self, stage: str, size: int, seconds: float, failed: bool) -> None:
        self._call("batch_finished", stage, size, seconds, failed)

    def rejected(self, stage: str, reason: str) -> None:
        self._call("rejected", stage, reason)

    def out_of_memory(self, stage: str, size: int) -> None:
        self._call("out_of_memory", stage, size)

    def batch_gpu(self, stage: str, seconds: float) -> None:
        self._call("batch_gpu", stage, seconds)


class Batcher(Generic[Item, Result]):
    """Groups items of one stage into batches and runs them on a worker thread."""

    def __init__(
        self,
        stage: str,
        run_batch: BatchFn[Item, Result],
        *,
        executor: Executor,
        max_batch_cost: int,
        max_delay_s: float,
        max_queue_size: int,
        max_batch_memory: int | None = None,
        observer: BatchObserver | None = None,
        load: WorkerLoad | None = None,
    ) -> None:
        """`load`: shared by every batcher whose batches run on `executor` (default: this
        batcher's own, right when it alone uses the executor)."""
        self.stage = stage
        self._run_batch = run_batch
        self._executor = executor
        self._max_cost = max_batch_cost
        self._max_delay_s = max_delay_s
        self._max_queue = max_queue_size
        self._max_memory = max_batch_memory
        self._observer = GuardedObserver(observer or BatchObserver())
        self._observer.declare(stage)
        self._queue: _Waiting[Item, Result] = _Waiting()
        self._wakeup = asyncio.Event()
        self._load = load or WorkerLoad()
        self._load.listen(self._wakeup)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._busy = False
        self._busy_since: float | None = None
        self.batches_run = 0
        self.items_run = 0
        self.largest_batch = 0
        # running mean of a successful batch's seconds: what a place in the queue costs
        self.batch_seconds: float | None = None

    @property
    def depth(self) -> int:
        """Items waiting (not counting the batch being computed)."""
        return len(self._queue)

    def busy_for(self) -> float:
        """Seconds the running batch has been computing (0 when none runs): the watchdog's
        measure of a stuck worker."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def idle(self) -> bool:
        """True when nothing waits and nothing runs: what a drain waits for."""
        return not self._queue and not self._busy

    def start(self) -> None:
        """Start the collector on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._collect(), name=f"batcher-{self.stage}"
            )
            self._task.add_done_callback(self._collector_ended)

    def _collector_ended(self, task: asyncio.Task[None]) -> None:
        """A collector that ends before `close` leaves its stage dead: say so, loudly."""
        if task.cancelled() or self._closing:
            return
        log.error("the %s batcher's collector ended: %r", self.stage, task.exception())

    async def close(self, timeout_s: float = 30.0) -> None:
        """Fail what still waits, let a running batch finish (bounded), stop the collector."""
        self._closing = True
        self._fail_waiting()
        self._wakeup.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    def _fail_waiting(self) -> None:
        while self._queue:
            entry = self._queue.popleft()
            if not entry.future.done():
                entry.future.set_exception(
                    ServiceError(503, "not_ready", "the service is shutting down")
                )
        self._observer.queue_depth(self.stage, 0)

    def expected_wait(self, cost: int = 1) -> float | None:
        """Seconds until an item of `cost` queued now would be answered, or None when
        nothing is ahead of it (or no batch has been measured yet).

        Batches run one after another, so the wait is what the running batch has left (or,
        while another stage's batch holds the worker, at most the queue delay; nothing on an
        idle worker), one measured batch per `max_batch_cost` of queued work ahead, and the
        item's own batch. Measured batches shrink or grow with load, so this follows the
        service's real rate.
        """
        per_batch = self.batch_seconds
        if per_batch is None or (not self._queue and not self._busy):
            return None
        if self._busy:
            running = max(0.0, per_batch - self.busy_for())
        else:
            running = self._max_delay_s if self._load.busy else 0.0
        ahead = math.ceil((self._queue.cost + cost) / self._max_cost)
        return running + ahead * per_batch

    def _admit(self, cost: int, deadline: float | None) -> None:
        """Refuse now (429) what the queue ahead would keep past its deadline (a 504 later),
        with a Retry-After of when the queue should have drained enough for it."""
        if deadline is None:
            return
        wait = self.expected_wait(cost)
        left = deadline - time.monotonic()
        if wait is None or wait <= left:
            return
        self._observer.rejected(self.stage, "queue_full")
        retry = max(1, math.ceil(wait - max(left, 0.0)))
        raise ServiceError(
            429,
            "queue_full",
            f"the {self.stage} queue would take about {wait:.1f} s to answer this request, "
            f"more than its deadline leaves ({max(left, 0.0):.1f} s); retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )

    async def submit(
        self,
        item: Item,
        *,
        cost: int = 1,
        memory: int = 0,
        deadline: float | None = None,
        admit_by: float | None = None,
        timing: dict[str, float] | None = None,
    ) -> Result:
        """Queue one item and wait for its result.

        `deadline` is a `time.monotonic()` instant; past it the item leaves the queue and
        the caller gets 504. Cancelling the awaiting task (client gone) drops the item.
        `admit_by` (default: `deadline`) is the instant admission is judged against, for a
        caller that keeps its own deadline(s) and cancels this call itself. `memory`: bytes
        the item's results hold until its batch ends; a batch's items hold at most
        `max_batch_memory` together (an item alone over it is the caller's to refuse).
        `timing`, when given, gets `queue`: the seconds the item waited before its batch
        ran (the rest of the call is the batch), for the response's phases and traces.
        """
        if self._closing:
            raise ServiceError(503, "not_ready", "the service is shutting down")
        if len(self._queue) >= self._max_queue:
            self._observer.rejected(self.stage, "queue_full")
            raise ServiceError(
                429,
                "queue_full",
                f"the {self.stage} queue is full ({self._max_queue} waiting); retry shortly",
                headers={"Retry-After": "1"},
            )
        if cost > self._max_cost:
            raise ServiceError(
                422,
                "invalid_request",
                f"request needs {cost} {self.stage} slots, more than one batch holds "
                f"({self._max_cost})",
            )
        self._admit(cost, deadline if admit_by is None else admit_by)
        loop = asyncio.get_running_loop()
        entry: _Entry[Item, Result] = _Entry(
            item, cost, memory, loop.create_future(), deadline=deadline
        )
        self._queue.append(entry)
        self._observer.queue_depth(self.stage, len(self._queue))
        self._wakeup.set()
        # a timer on the item's future, not asyncio.wait_for(shield(...)): their waiter,
        # outer future and callbacks were a few % of the engine loop per call
        timer = None
        if deadline is not None:
            timer = loop.call_at(
                loop.time() + max(0.0, deadline - time.monotonic()), self._expire, entry
            )
        try:
            result = await entry.future
        except asyncio.CancelledError as exc:  # the caller went (the future with it)
            reason = "deadline" if exc.args == (DEADLINE_CANCEL,) else "cancelled"
            self._abandon(entry, reason)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if timing is not None and entry.started is not None:
            timing["queue"] = entry.started - entry.enqueued
        return result

    def _expire(self, entry: _Entry[Item, Result]) -> None:
        """The item's deadline passed before its answer: 504 now, and out of the queue (a
        running one finishes unobserved)."""
        if entry.future.done():
            return
        entry.future.set_exception(
            ServiceError(
                504, "deadline_exceeded", "the request's deadline passed before it was served"
            )
        )
        self._observer.rejected(self.stage, "deadline")
        self._dequeue(entry)

    def _run_splitting(self, items: list[Item]) -> Sequence[Result | BaseException]:
        """Run a batch on the worker; on out-of-memory, halve it and run the halves.

        A request that cannot run even alone fails by itself with 507; the others of its
        batch still get their answers, and the freed memory goes back to the allocator.
        """
        try:
            return self._run_batch(items)
        except Exception as exc:
            if not _is_out_of_memory(exc):
                raise
            self._observer.out_of_memory(self.stage, len(items))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if len(items) == 1:
                log.warning("%s: one request does not fit in device memory", self.stage)
                return [
                    ServiceError(
                        507,
                        "out_of_memory",
                        f"the {self.stage} stage ran out of device memory on this request "
                        "alone; send a smaller image or fewer prompts",
                    )
                ]
            half = len(items) // 2
            log.warning("%s: batch of %d ran out of memory; splitting", self.stage, len(items))
            return [*self._run_splitting(items[:half]), *self._run_splitting(items[half:])]

    def _abandon(self, entry: _Entry[Item, Result], reason: str) -> None:
        """Drop an item whose caller stopped waiting; a running one finishes unobserved.
        (A caller cancelled while awaiting the future has cancelled it too: still a drop.)"""
        if not entry.future.done() or entry.future.cancelled():
            entry.future.cancel()
            self._observer.rejected(self.stage, reason)
        self._dequeue(entry)

    def _dequeue(self, entry: _Entry[Item, Result]) -> None:
        try:
            self._queue.remove(entry)
        except ValueError:  # in a batch already, or pruned
            return
        self._observer.queue_depth(self.stage, len(self._queue))

    def _prune(self) -> None:
        """Remove items nobody waits for any more, so they are never computed."""
        now = time.monotonic()
        kept: list[_Entry[Item, Result]] = []
        for entry in self._queue:
            if entry.future.done():
                continue
            if entry.deadline is not None and now >= entry.deadline:
                entry.future.set_exception(
                    ServiceError(504, "deadline_exceeded", "the request's deadline passed")
                )
                self._observer.rejected(self.stage, "deadline")
                continue
            kept.append(entry)
        if len(kept) != len(self._queue):
            self._queue = _Waiting(kept)

    def _take_batch(self) -> list[_Entry[Item, Result]]:
        batch: list[_Entry[Item, Result]] = []
        cost = memory = 0
        limit = self._max_memory
        while self._queue and cost + self._queue.first().cost <= self._max_cost:
            # memory bounds a batch too, but never keeps an item from a batch of its own
            if batch and limit is not None and memory + self._queue.first().memory > limit:
                break
            entry = self._queue.popleft()
            batch.append(entry)
            cost += entry.cost
            memory += entry.memory
        self._observer.queue_depth(self.stage, len(self._queue))
        return batch

    def _batch_full(self) -> bool:
        if self._queue.cost >= self._max_cost:
            return True
        limit = self._max_memory
        return limit is not None and self._queue.memory >= limit

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self._collect_once(loop)
            except Exception:  # the stage must outlive one bad round: it serves everyone
                log.exception("%s batcher: a round failed; collecting on", self.stage)
                if self._queue:
                    self._wakeup.set()
        self._fail_waiting()

    async def _collect_once(self, loop: asyncio.AbstractEventLoop) -> None:
        """One round: wait (while the worker is busy) for a fuller batch, then run one."""
        self._prune()
        if not self._queue:
            return
        # While the worker computes, collect: until it is idle, the batch is full or the
        # oldest item's delay runs out. An idle worker takes what is here at once.
        until = self._queue.first().enqueued + self._max_delay_s
        while self._load.busy and not self._batch_full():
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                break
            self._wakeup.clear()
        self._prune()
        batch = self._take_batch()
        if not batch or self._closing:
            self._queue.put_back(batch)
            return
        try:
            await self._run(loop, batch)
        finally:  # whatever happened, nobody in this batch is left waiting for ever
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(_internal(self.stage, RuntimeError()))
        # not kept while the collector waits: the items hold their inputs (an image's
        # pixels, lent by a frontend until nothing here references them)
        del batch
        if self._queue:
            self._wakeup.set()

    async def _run(
        self, loop: asyncio.AbstractEventLoop, batch: list[_Entry[Item, Result]]
    ) -> None:
        now = time.monotonic()
        for entry in batch:
            entry.started = now
        self._observer.batch_started(
            self.stage, len(batch), sum(e.cost for e in batch), [now - e.enqueued for e in batch]
        )
        self._busy = True
        self._busy_since = time.monotonic()
        self._load.started()
        started = time.perf_counter()
        failed = False
        try:
            results = await loop.run_in_executor(
                self._executor, self._run_splitting, [e.item for e in batch]
            )
            if len(results) != len(batch):
                raise RuntimeError(
                    f"{self.stage} batch returned {len(results)} results for {len(batch)} items"
                )
        except Exception as exc:
            failed = True
            log.exception("%s batch of %d failed", self.stage, len(batch))
            error = exc if isinstance(exc, ServiceError) else _internal(self.stage, exc)
            results = [error] * len(batch)
        finally:
            self._busy = False
            self._busy_since = None
            self._load.finished()
        if not failed:
            took = time.perf_counter() - started
            mean = self.batch_seconds
            self.batch_seconds = took if mean is None else mean + _RATE_WEIGHT * (took - mean)
        self.batches_run += 1
        self.items_run += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))
        self._observer.batch_finished(self.stage, len(batch), time.perf_counter() - started, failed)
        for entry, result in zip(batch, results, strict=True):
            if entry.future.done():
                continue
            if isinstance(result, BaseException):
                entry.future.set_exception(result)
            else:
                entry.future.set_result(result)


def with_queues(
    timing_ms: dict[str, float], queues: dict[str, dict[str, float]]
) -> dict[str, float]:
    """`timing_ms` with `<phase>_queue` after each phase whose queue wait was measured
    (`Batcher.submit`'s `timing`): the part of the phase spent waiting for a batch, which
    the phase's own time includes."""
    out: dict[str, float] = {}
    for phase, ms in timing_ms.items():
        out[phase] = ms
        wait = queues.get(phase, {}).get("queue")
        if wait is not None:
            out[f"{phase}_queue"] = round(wait * 1000.0, 3)
    return out


# How the CPU allocator says it: a plain RuntimeError ("DefaultCPUAllocator: can't allocate
# memory: you tried to allocate N bytes"), or "not enough memory" on some platforms.
_CPU_ALLOCATION_FAILURES = ("can't allocate memory", "not enough memory")


def _is_out_of_memory(exc: BaseException) -> bool:
    """The device's out-of-memory, or the CPU allocator's: both are the batch's size."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(
        text in str(exc) for text in _CPU_ALLOCATION_FAILURES
    )


def _internal(stage: str, exc: BaseException) -> ServiceError:
    # What failed, not where: torch's text names its source files and allocator internals
    # (`alloc_cpu.cpp:127`); the log has all of it.
    return ServiceError(500, "internal", f"the {stage} batch failed ({type(exc).__name__})")
