"""One client process of a step (asyncio), and the step spread over processes.

Every process takes rate/N of each kind on its own seeded Poisson schedule; all start at
one wall-clock instant set by the parent. Each sends over HTTP/1.1 keep-alive connections,
about rate/N x `inflight_s` of them (`WirePool`, the lean client of wire.py, or
`ShardedPools` of httpx clients with `client="httpx"`): a request that finds none free waits
for one, and that wait is part of its latency, as every wait is (and shows as client lag). No
retries: whatever the service answers is counted by its status. Each 200's `timing_ms` is
kept with its sample, for the report's breakdown of where the time went (phases.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing.pool
import random
import resource
import time
from dataclasses import dataclass, replace
from typing import Literal

import httpx

from bench.openloop.kinds import Photo, RequestMaker
from bench.openloop.phases import timing_of
from bench.openloop.pools import ShardedPools
from bench.openloop.schedule import Outcome, Sample, arrivals, run_open_loop
from bench.openloop.wire import WirePool

MAX_POOL = 1000  # connections per process (in pools of 32: see pools.py)
SPIN_MAX_RATE = 200.0  # req/s of one process up to which `spin_s` applies


@dataclass(frozen=True)
class StepSpec:
    """One step (one rate, or one mix) as every process gets it, pickled whole."""

    url: str
    rates: tuple[tuple[str, float], ...]  # (kind, req/s over all processes)
    seconds: float  # measured, after the warm-up
    warmup_s: float
    timeout_s: float  # per request, from the moment it is sent
    processes: int
    seed: int
    nonce: str  # one per tool run: segment photos never repeat across runs
    images: tuple[Photo, ...]
    image_ids: tuple[str, ...] = ()  # of `images`, embedded beforehand (click)
    api_key: str | None = None
    inflight_s: float = 2.0  # pool size: this many seconds of arrivals may be in flight
    start_wall: float = 0.0  # time.time() at which every process starts its schedule
    client: Literal["wire", "httpx"] = "wire"  # wire.py's client, or httpx (to compare)
    spin_s: float = 0.0  # the dispatcher's busy wait before each arrival (schedule.py)


def pool_size(spec: StepSpec) -> int:
    per_process = sum(rate for _, rate in spec.rates) / spec.processes
    return max(4, min(MAX_POOL, math.ceil(per_process * spec.inflight_s) + 4))


# what ends a request without a response: a timeout, or the connection failing (httpx's
# errors; the wire client's OSError, its WireError for a response cut short or unreadable)
NO_RESPONSE = (TimeoutError, httpx.TransportError, OSError)


def classify_error(exc: BaseException) -> str:
    """The status of a request that got no response."""
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, NO_RESPONSE):
        return "conn_error"
    return f"error:{type(exc).__name__}"


async def run_process(spec: StepSpec, index: int) -> list[Sample]:
    """Process `index`'s share of the step, on this event loop."""

    def rng_for(kind: str) -> random.Random:
        return random.Random(f"schedule:{spec.seed}:{index}:{kind}")

    total_s = spec.warmup_s + spec.seconds
    rates = {kind: rate / spec.processes for kind, rate in spec.rates}
    schedule = arrivals(rates, total_s, rng_for)
    # the step's seed joins the run's nonce: photo tails never repeat across steps either
    prompts = random.Random(f"prompts:{spec.seed}:{index}")
    maker = RequestMaker(spec.images, spec.image_ids, prompts, f"{spec.nonce}.{spec.seed}", index)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # the server learns when this client gives up, so it refuses (429) or drops work it
    # could not finish by then, as a real client with a timeout should ask it to
    headers["X-Request-Timeout-Ms"] = str(int(spec.timeout_s * 1000))
    pools: WirePool | ShardedPools
    if spec.client == "wire":
        pools = WirePool(spec.url, pool_size(spec), headers)
    elif spec.client == "httpx":
        pools = ShardedPools(spec.url, pool_size(spec), spec.timeout_s, headers)
    else:
        raise ValueError(f"client {spec.client!r}: wire or httpx")
    loop = asyncio.get_running_loop()

    async def send(kind: str, seq: int) -> Outcome:
        request = maker.make(kind, seq)
        sent = math.nan
        try:
            async with asyncio.timeout(spec.timeout_s), pools.slot() as http:
                sent = loop.time()
                code, content = await http.post(request.path, request.body, request.headers)
        except NO_RESPONSE as exc:
            return Outcome(classify_error(exc), 0, sent)
        status = str(code)
        return Outcome(status, len(content), sent, timing_of(content) if status == "200" else None)

    try:
        # the parent's start instant on this process's loop clock (monotonic)
        start = loop.time() + (spec.start_wall - time.time())
        # busy-wait only at low rates, where a late wake-up is a large share of a latency;
        # above, the load's own responses keep the loop awake, and the CPU is better spent
        spin = spec.spin_s if sum(rates.values()) <= SPIN_MAX_RATE else 0.0
        return await run_open_loop(schedule, send, start, spin)
    finally:
        await pools.aclose()


def _raise_open_files_limit() -> None:
    """A pool of hundreds of connections needs that many descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        # a container may refuse: then the pool can run out of descriptors, counted as
        # conn_error
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def process_main(job: tuple[StepSpec, int]) -> tuple[list[Sample], float, float]:
    """The process's samples, and the CPU and wall seconds it spent on them."""
    spec, index = job
    _raise_open_files_limit()
    cpu, wall = time.process_time(), time.perf_counter()
    samples = asyncio.run(run_process(spec, index))
    return samples, time.process_time() - cpu, time.perf_counter() - wall


def run_step(
    spec: StepSpec,
    pool: multiprocessing.pool.Pool | None,
    lead_in_s: float = 1.0,
    cores: list[float] | None = None,
) -> list[Sample]:
    """Every process's samples, raw, for exact percentiles over all of them. Without a pool
    (one process) the step runs here, on a new event loop.

    `cores` gets the cores the load's processes kept busy over the step (their CPU
    seconds over its wall seconds): on a host the server shares, what the client took."""
    spec = replace(spec, start_wall=time.time() + lead_in_s)
    jobs = [(spec, i) for i in range(spec.processes)]
    if pool is None:
        if spec.processes != 1:
            raise ValueError("several processes need a pool")
        results = [process_main(jobs[0])]
    else:
        results = pool.map(process_main, jobs, chunksize=1)
    if cores is not None:
        wall = max(w for _, _, w in results)
        cores.append(sum(c for _, c, _ in results) / wall if wall > 0 else 0.0)
    return [s for samples, _, _ in results for s in samples]
