"""The dynamic batcher on its own: grouping, limits, deadlines, cancellation, isolation."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.engine.batcher import Batcher, BatchObserver, GuardedObserver, WorkerLoad
from server.errors import ServiceError
from server.metrics import Metrics


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


def test_each_item_learns_how_long_it_waited_for_its_batch(executor):
    """`timing` gets the queue wait: nothing for the first item on an idle worker, at least
    the running batch's time for one queued behind it."""
    worker = Worker(delay_s=0.05)

    async def main():
        batcher, _ = make(worker, executor, max_batch_cost=1)
        batcher.start()
        first: dict[str, float] = {}
        second: dict[str, float] = {}
        started = time.monotonic()
        results = await asyncio.gather(
            batcher.submit(2, timing=first), batcher.submit(3, timing=second)
        )
        took = time.monotonic() - started
        await batcher.close()
        return results, first, second, took

    results, first, second, took = run(main())
    assert results == [4, 9]
    assert 0 <= first["queue"] < 0.04  # dispatched at once: the worker was idle
    assert 0.04 <= second["queue"] <= took  # behind the first batch's 50 ms


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


def test_admission_counts_only_the_work_still_queued(executor):
    """The cost ahead that admission judges by follows what leaves the queue (cancelled,
    expired, taken into a batch), not only what enters it."""
    worker = Worker()

    async def main():
        batcher, _ = make(worker, executor, max_batch_cost=4)
        batcher.start()
        await batcher.submit(1)  # a measured batch: admission has a batch's seconds
        worker.gate.clear()
        worker.started.clear()
        blocker = asyncio.create_task(batcher.submit(2))
        while not worker.started.is_set():
            await asyncio.sleep(0.01)
        queued = [asyncio.create_task(batcher.submit(i, cost=2)) for i in range(3, 7)]
        expiring = asyncio.create_task(batcher.submit(7, cost=4, deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0.01)
        per = batcher.batch_seconds
        waits = [batcher.expected_wait()]  # 12 queued + 1: four batches ahead
        queued[0].cancel()
        queued[1].cancel()
        await asyncio.sleep(0.01)
        waits.append(batcher.expected_wait())  # 8 + 1: three
        await asyncio.gather(expiring, return_exceptions=True)
        waits.append(batcher.expected_wait())  # 4 + 1: two
        worker.gate.set()
        results = await asyncio.gather(blocker, *queued[2:])
        idle = batcher.expected_wait()
        await batcher.close()
        return per, waits, results, idle

    per, waits, results, idle = run(main())
    for batches, wait in zip((4, 3, 2), waits, strict=True):
        assert batches * per <= wait <= (batches + 1) * per
    assert results == [4, 25, 36]
    assert idle is None  # nothing queued, nothing running


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


def test_lone_request_on_an_idle_worker_goes_at_once(executor):
    # the queue delay is for collecting while the worker computes; idle, it is only latency
    async def main():
        batcher, rec = make(Worker(), executor, max_delay_s=0.5)
        batcher.start()
        took = []
        for i in range(3):
            start = time.perf_counter()
            assert await batcher.submit(i) == i * i
            took.append(time.perf_counter() - start)
        await batcher.close()
        return took, rec

    took, rec = run(main())
    assert rec.sizes == [1, 1, 1]
    assert max(took) < 0.25, took  # 500 ms if it had waited for the delay


def test_items_arriving_while_a_batch_runs_ride_together_in_the_next(executor):
    worker = Worker()
    worker.gate.clear()

    async def main():
        batcher, rec = make(worker, executor, max_delay_s=5.0)
        batcher.start()
        first = asyncio.create_task(batcher.submit(1))
        while not worker.started.is_set():  # item 1 runs alone, held at the gate
            await asyncio.sleep(0.005)
        later = [asyncio.create_task(batcher.submit(i)) for i in range(2, 6)]
        await asyncio.sleep(0.05)
        assert batcher.depth == 4  # collected, not dispatched, while the worker computes
        start = time.perf_counter()
        worker.gate.set()
        results = await asyncio.gather(first, *later)
        took = time.perf_counter() - start
        await batcher.close()
        return results, took, rec

    results, took, rec = run(main())
    assert results == [1, 4, 9, 16, 25]
    assert rec.sizes == [1, 4]
    assert took < 1.0, took  # the batch ended: the next went without waiting out 5 s


def test_queue_delay_still_bounds_the_wait_behind_a_long_batch(executor):
    other, mine = Worker(), Worker()
    other.gate.clear()

    async def main():
        load = WorkerLoad()
        pool = ThreadPoolExecutor(1)  # a second thread, so "mine" can run while "other" holds
        slow, _ = make(other, pool, max_delay_s=0.0, load=load)
        fast, rec = make(mine, executor, max_delay_s=0.05, load=load)
        slow.start()
        fast.start()
        held = asyncio.create_task(slow.submit(1))
        while not other.started.is_set():
            await asyncio.sleep(0.005)
        start = time.perf_counter()
        results = await asyncio.gather(*(fast.submit(i) for i in range(3)))
        took = time.perf_counter() - start
        other.gate.set()
        await held
        await slow.close()
        await fast.close()
        pool.shutdown(wait=True)
        return results, took, rec

    results, took, rec = run(main())
    assert results == [0, 1, 4]
    assert rec.sizes == [3]
    assert 0.04 <= took < 1.0, took  # waited out its 50 ms delay, no longer


def test_batchers_sharing_a_worker_collect_while_the_other_computes(executor):
    enc, dec = Worker(), Worker()
    enc.gate.clear()

    async def main():
        load = WorkerLoad()
        encoder, enc_rec = make(enc, executor, max_delay_s=5.0, load=load)
        decoder, dec_rec = make(dec, executor, max_delay_s=5.0, load=load)
        encoder.start()
        decoder.start()
        encoding = asyncio.create_task(encoder.submit(1))
        while not enc.started.is_set():
            await asyncio.sleep(0.005)
        decoding = [asyncio.create_task(decoder.submit(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        waiting = decoder.depth  # the encoder's batch holds the worker: the decoder collects
        enc.gate.set()
        start = time.perf_counter()
        results = await asyncio.gather(encoding, *decoding)
        took = time.perf_counter() - start
        await encoder.close()
        await decoder.close()
        return waiting, results, took, enc_rec, dec_rec, load

    waiting, results, took, enc_rec, dec_rec, load = run(main())
    assert waiting == 3
    assert results == [1, 0, 1, 4]
    assert enc_rec.sizes == [1] and dec_rec.sizes == [3]
    assert took < 1.0, took  # the worker went idle: the decoder's batch went at once
    assert not load.busy


def test_worker_load_is_one_per_executor(executor):
    assert WorkerLoad.of(executor) is WorkerLoad.of(executor)
    other = ThreadPoolExecutor(1)
    try:
        assert WorkerLoad.of(other) is not WorkerLoad.of(executor)
    finally:
        other.shutdown()


class FailingObserver(Recorder):
    """Metrics that break after the first batch (a metrics file that cannot grow, say)."""

    def batch_started(self, stage, size, cost, waits_s) -> None:
        super().batch_started(stage, size, cost, waits_s)
        if len(self.sizes) > 1:
            raise OSError("no space left on device")

    def batch_finished(self, stage, size, seconds, failed) -> None:
        if len(self.sizes) > 2:
            raise OSError("no space left on device")


def test_a_failing_observer_never_stops_the_stage(executor, caplog):
    """Before, an observer raising inside the collector ended it: the stage took no batch
    again and every later request waited for its deadline, with nothing logged."""
    worker = Worker()
    rec = FailingObserver()

    async def main():
        batcher = Batcher(
            "test", worker, executor=executor, observer=rec,
            max_batch_cost=2, max_delay_s=0.0, max_queue_size=64,
        )  # fmt: skip
        batcher.start()
        answers = []
        for round_ in range(5):  # one batch after another, each after the observer broke
            answers += await asyncio.wait_for(
                asyncio.gather(*(batcher.submit(10 * round_ + i) for i in range(2))), 5
            )
        await batcher.close()
        return answers

    answers = run(main())
    assert answers == [(10 * r + i) ** 2 for r in range(5) for i in range(2)]
    assert len(rec.sizes) >= 5  # the observer kept being called, and kept failing
    logged = [r.getMessage() for r in caplog.records]
    assert sum("batch_started failed" in m for m in logged) == 1  # once, not per batch
    assert sum("batch_finished failed" in m for m in logged) == 1


def test_a_failing_gpu_span_observer_is_logged_once_and_never_raised(caplog):
    """`batch_gpu` is called on a stage's worker thread, inside the batch function: a
    metric failing there must not fail the batch (server.engine.services._stage_fn)."""

    class Broken(Recorder):
        def batch_gpu(self, stage, seconds) -> None:
            raise OSError("no space left on device")

    guarded = GuardedObserver(Broken())
    for _ in range(3):
        guarded.batch_gpu("sam_decoder", 0.002)
    logged = [r.getMessage() for r in caplog.records]
    assert sum("batch_gpu failed" in m for m in logged) == 1


def test_the_gpu_span_lands_in_its_histogram():
    metrics = Metrics()
    metrics.batch_gpu("sam_decoder", 0.004)
    metrics.batch_gpu("sam_decoder", 0.002)
    samples = {
        s.name: s.value
        for family in metrics.registry.collect()
        if family.name == "serve_batch_gpu_seconds"
        for s in family.samples
        if s.labels.get("stage") == "sam_decoder" and not s.name.endswith("_bucket")
    }
    assert samples["serve_batch_gpu_seconds_count"] == 2
    assert samples["serve_batch_gpu_seconds_sum"] == pytest.approx(0.006)
