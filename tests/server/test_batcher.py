"""The dynamic batcher on its own: grouping, limits, deadlines, cancellation, isolation."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.engine.batcher import Batcher, BatchObserver
from server.errors import ServiceError


class Recorder(BatchObserver):
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.rejections: list[str] = []
        self.depths: list[int] = []

    def queue_depth(self, stage: str, depth: int) -> None:
        self.depths.append(depth)

    def batch_started(self, stage, size, cost, waits_s) -> None:
        self.sizes.append(size)

    def rejected(self, stage: str, reason: str) -> None:
        self.rejections.append(reason)


class Worker:
    """A real batch function: squares numbers, remembers what it computed."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def __call__(self, items: list[int]) -> list[int | BaseException]:
        self.started.set()
        self.gate.wait(30)
        time.sleep(self.delay_s)
        self.seen.extend(items)
        out: list[int | BaseException] = []
        for x in items:
            if x == -1:
                out.append(ServiceError(422, "invalid_request", "minus one"))
            elif x == -2:
                raise RuntimeError("the whole batch broke")
            else:
                out.append(x * x)
        return out


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True)


def make(worker, executor, **kw) -> tuple[Batcher[int, int], Recorder]:
    rec = Recorder()
    args = {"max_batch_cost": 8, "max_delay_s": 0.02, "max_queue_size": 64} | kw
    return Batcher("test", worker, executor=executor, observer=rec, **args), rec


def run(coro):
    return asyncio.run(coro)


def test_concurrent_items_are_batched_and_each_gets_its_own_result(executor):
    worker = Worker(delay_s=0.01)

    async def main():
        batcher, rec = make(worker, executor)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(32)))
        await batcher.close()
        return results, rec

    results, rec = run(main())
    assert results == [i * i for i in range(32)]
    assert max(rec.sizes) > 1
    assert all(size <= 8 for size in rec.sizes)
    assert sum(rec.sizes) == 32
    assert rec.depths[-1] == 0


def test_costs_bound_a_batch(executor):
    worker = Worker()

    async def main():
        batcher, rec = make(worker, executor, max_batch_cost=10)
        batcher.start()
        await asyncio.gather(*(batcher.submit(i, cost=4) for i in range(6)))
        await batcher.close()
        return rec

    rec = run(main())
    assert all(size <= 2 for size in rec.sizes)  # 3 x 4 > 10


def test_item_costlier_than_a_batch_is_refused(executor):
    async def main():
        batcher, _ = make(Worker(), executor, max_batch_cost=4)
        batcher.start()
        with pytest.raises(ServiceError) as err:
            await batcher.submit(1, cost=5)
        await batcher.close()
        return err.value

    assert run(main()).status == 422


def test_full_queue_gives_429_with_retry_after(executor):
    worker = Worker()
    worker.gate.clear()  # hold the worker so the queue fills

    async def main():
        batcher, rec = make(worker, executor, max_queue_size=4, max_batch_cost=1)
        batcher.start()
        tasks = [asyncio.create_task(batcher.submit(0))]
        while not worker.started.is_set():  # item 0 runs, held at the gate
            await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(batcher.submit(i)) for i in range(1, 5)]
        while batcher.depth < 4:  # four wait behind it: the queue is full
            await asyncio.sleep(0.01)
        with pytest.raises(ServiceError) as err:
            await batcher.submit(99)
        worker.gate.set()
        results = await asyncio.gather(*tasks)
        await batcher.close()
        return err.value, results, rec

    error, results, rec = run(main())
    assert error.status == 429 and error.code == "queue_full"
    assert error.headers and "Retry-After" in error.headers
    assert results == [i * i for i in range(5)]
    assert "queue_full" in rec.rejections


def test_expired_deadline_gives_504_and_is_not_computed(executor):
    worker = Worker()
    worker.gate.clear()

    async def main():
        batcher, rec = make(worker, executor, max_batch_cost=1)
        batcher.start()
        blocker = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.05)
        with pytest.raises(ServiceError) as err:
            await batcher.submit(7, deadline=time.monotonic() + 0.05)
        worker.gate.set()
        await blocker
        await asyncio.sleep(0.05)
        await batcher.close()
        return err.value, rec

    error, rec = run(main())
    assert error.status == 504 and error.code == "deadline_exceeded"
    assert 7 not in worker.seen
    assert "deadline" in rec.rejections


def test_cancelled_request_is_dropped_not_computed(executor):
    worker = Worker()
    worker.gate.clear()

    async def main():
        batcher, rec = make(worker, executor, max_batch_cost=1)
        batcher.start()
        blocker = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.05)
        doomed = asyncio.create_task(batcher.submit(5))
        await asyncio.sleep(0.02)
        doomed.cancel()
        worker.gate.set()
        await blocker
        after = await batcher.submit(3)
        await batcher.close()
        return after, rec

    after, rec = run(main())
    assert after == 9
    assert 5 not in worker.seen
    assert "cancelled" in rec.rejections


def test_failures_stay_in_their_batch(executor):
    worker = Worker()

    async def main():
        batcher, _ = make(worker, executor, max_batch_cost=1)
        batcher.start()
        outcomes = await asyncio.gather(
            batcher.submit(-2), batcher.submit(-1), batcher.submit(4), return_exceptions=True
        )
        again = await batcher.submit(5)
        await batcher.close()
        return outcomes, again

    outcomes, again = run(main())
    whole, single, fine = outcomes
    # what failed, not where: the exception's own text stays in the log
    assert isinstance(whole, ServiceError) and whole.status == 500
    assert whole.message == "the test batch failed (RuntimeError)"
    assert isinstance(single, ServiceError) and single.status == 422
    assert fine == 16
    assert again == 25


def test_close_fails_waiting_items_with_503(executor):
    worker = Worker()
    worker.gate.clear()

    async def main():
        batcher, _ = make(worker, executor, max_batch_cost=1)
        batcher.start()
        running = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(batcher.submit(2))
        await asyncio.sleep(0.01)
        closing = asyncio.create_task(batcher.close())
        await asyncio.sleep(0.01)
        worker.gate.set()
        await closing
        return await asyncio.gather(running, waiting, return_exceptions=True)

    running, waiting = run(main())
    assert running == 1
    assert isinstance(waiting, ServiceError) and waiting.status == 503
