"""The engine process's event loop under load, without HTTP: calls/s and its CPU per call.

On the H100 the service's classify and click paths stopped near 700-900 calls/s with the
GPU mostly idle and the engine's one event loop busy (docs/BENCHMARKS.md, issue 19). That
loop's work (reading the socket, unpickling, a task per call, the batchers' rounds, the
replies) is the same Python on any host, so it can be measured here. This starts one
engine process (`engine_main`, the production entry point) and `--clients` processes that
each speak to it as a frontend does (`EngineClient`, pixels in their own shared memory),
open loop at each rate: Poisson arrivals spread over the clients, latency from each call's
scheduled time. Per rate it prints ok/s, p50/p99 ms, errors, and the engine's CPU per
answered call: its event loop (the main thread), its stage workers, and in all.

`--stub-ms X` replaces the decoder's and Swin's batch with a sleep of X ms (the GIL let go,
as a GPU call's wait lets it go) that returns the answer the real stage gave for the first
item; without it the tests' small models compute on the CPU, and the 2 cores, not the
loop, are the limit. The encoder stays real (clicks need embeddings).

    python -m bench.engine_loop --kinds classify click --rates 200 500 1000 --stub-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import random
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage

from bench.common import DEFAULT_IMAGES, environment, print_table, write_json
from bench.frontend_cpu import process_cpu_s, thread_cpu_s
from bench.openloop.report import percentile
from server.domain import Image, Prompt, SegmentRequest
from server.errors import ServiceError
from server.settings import Settings

STUBBED_STAGES = ("sam_decoder", "swin")
CLIENT_TIMEOUT_S = 5.0


def _settings(args: argparse.Namespace) -> Settings:
    """`tests`: the tests' small models on the CPU; `defaults`: the README's (SERVE_*
    variables apply), as `python -m server` would serve them on this machine."""
    if args.models == "defaults":
        return Settings(log_level="WARNING")  # type: ignore[call-arg]
    return Settings(
        device="cpu", sam_model="vit_tiny", swin_model="swin_test", mask_rle="device",
        max_batch_size=8, classify_max_batch_size=64, batch_buckets=[1, 2, 4, 8],
        max_queue_delay_ms=5.0, decoder_max_batch_prompts=64, log_level="WARNING",
        max_queue_size=100_000,
    )  # type: ignore[call-arg]  # fmt: skip


def _stub_stages(stub_s: float) -> None:
    """Each stubbed stage answers every item with the real answer to its first item, after
    a sleep of `stub_s` (the GPU's share of a batch, spent without the GIL)."""
    from server.engine.services import Engine

    real = Engine._stage_fn

    def stage_fn(self: Engine, stage: str, fn: Callable[[list[Any]], Any]) -> Any:
        run = real(self, stage, fn)
        if stage not in STUBBED_STAGES:
            return run
        answer: list[Any] = []

        def run_batch(items: list[Any]) -> list[Any]:
            if not answer:
                answer.append(run(items[:1])[0])
            time.sleep(stub_s)
            return [answer[0]] * len(items)

        return run_batch

    Engine._stage_fn = stage_fn  # type: ignore[method-assign]


def _engine(settings: Settings, address: str, stub_ms: float | None) -> None:
    """The engine process's entry: `engine_main`, its stages stubbed when asked."""
    if stub_ms is not None:
        _stub_stages(stub_ms / 1000.0)
    from server.engine.process import engine_main

    engine_main(settings, address, "engine-0")


@dataclass(frozen=True)
class Photo:
    image_id: str
    pixels: np.ndarray  # uint8 [h, w, 3]: what a frontend's decode for Swin hands over
    width: int
    height: int


def _photos(folder: Path) -> list[Photo]:
    photos = []
    for n, path in enumerate(sorted(folder.glob("*.jpg"))):
        with PILImage.open(path) as image:
            width, height = image.size
            small = image.convert("RGB")
            small.thumbnail((256, 256))
            photos.append(Photo(f"{n:064x}", np.asarray(small), width, height))
    if not photos:
        raise SystemExit(f"no .jpg photos in {folder} (pass --images)")
    return photos


async def _client_run(
    address: str, kind: str, folder: Path, schedule: list[float], start_at: float, seed: int
) -> list[tuple[str, float]]:
    """Send `kind` calls at `start_at + schedule[i]` (time.time()); (outcome, ms) each."""
    async with _connected(address, 256 << 20) as (client, pixels):
        photos = _photos(folder)
        rng = random.Random(seed)

        async def one(at: float) -> tuple[str, float]:
            delay = at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            photo = photos[rng.randrange(len(photos))]
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            try:
                if kind == "classify":
                    shared = pixels.copy_in(photo.pixels)
                    image = Image(photo.image_id, shared, photo.width, photo.height)
                    try:
                        await client.classify(image, 5, deadline)
                    finally:  # this side's hold; the engine's goes back by a release
                        pixels.release_array(shared)
                else:
                    x, y = rng.uniform(0, photo.width - 1), rng.uniform(0, photo.height - 1)
                    prompt = Prompt(points=((x, y),), labels=(1,))
                    request = SegmentRequest((prompt,), image_id=photo.image_id,
                                             deadline=deadline)  # fmt: skip
                    await client.segment(request)
                outcome = "ok"
            except ServiceError as exc:
                outcome = str(exc.status)
            return outcome, (time.time() - at) * 1000

        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        return await asyncio.gather(*(one(start_at + t) for t in schedule))


async def _prepare(address: str, folder: Path) -> None:
    """Wait until the engine is ready, then cache every photo's embedding (for clicks)."""
    async with _connected(address, 64 << 20) as (client, pixels):
        for photo in _photos(folder):
            shared = pixels.copy_in(photo.pixels)
            await client.embed(Image(photo.image_id, shared, photo.width, photo.height))
            pixels.release_array(shared)


@contextlib.asynccontextmanager
async def _connected(address: str, shared_bytes: int) -> AsyncIterator[tuple[Any, Any]]:
    """An engine client with shared pixel memory of its own, as a frontend has, once the
    engine says it is ready."""
    from server.http.engine_client import EngineClient
    from server.http.pixels import SharedPixels

    pixels = SharedPixels(shared_bytes)
    client = EngineClient(address, pixels)
    await client.start()
    try:
        while not client.ready:
            await asyncio.sleep(0.05)
        yield client, pixels
    finally:
        await client.close()
        pixels.close()


def _import_client(_: int) -> None:
    import server.http.engine_client
    import server.http.pixels  # noqa: F401


def _client(*args: Any) -> list[tuple[str, float]]:
    return asyncio.run(_client_run(*args))


def _schedules(rate: float, seconds: float, clients: int, seed: int) -> list[list[float]]:
    """Poisson arrivals at `rate` for `seconds`, dealt to the clients in turn."""
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return [times[i::clients] for i in range(clients)]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--kinds", nargs="+", default=["classify", "click"],
                   choices=["classify", "click"])  # fmt: skip
    p.add_argument("--rates", nargs="+", type=float, default=[200.0, 500.0, 1000.0])
    p.add_argument("--seconds", type=float, default=5.0, help="per rate")
    p.add_argument("--clients", type=int, default=2, help="client processes (frontends)")
    p.add_argument("--stub-ms", type=float, default=None, help="stub stage batch, ms")
    p.add_argument("--models", choices=["tests", "defaults"], default="tests")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="s (GPU: compiling)")
    p.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--spy", type=Path, default=None,
                   help="py-spy the engine in each step: <kind>-<rate>.raw here")  # fmt: skip
    args = p.parse_args(argv)

    context = multiprocessing.get_context("spawn")
    folder = Path(tempfile.mkdtemp(prefix="engine-loop-"))
    address = f"ipc://{folder}/engine-0.sock"
    engine = context.Process(target=_engine, args=(_settings(args), address, args.stub_ms))
    engine.start()
    assert engine.pid is not None
    rows: list[dict[str, Any]] = []
    try:
        asyncio.run(asyncio.wait_for(_prepare(address, args.images), args.ready_timeout))
        with context.Pool(args.clients) as pool:
            pool.map(_import_client, range(args.clients))
            for kind in args.kinds:
                for rate in args.rates:
                    schedules = _schedules(rate, args.seconds, args.clients, int(rate))
                    start_at = time.time() + 2.0  # the clients connect meanwhile
                    spy = _spy(args.spy, kind, rate, engine.pid, args.seconds + 2.5)
                    before, threads0 = process_cpu_s(engine.pid), thread_cpu_s(engine.pid)
                    jobs = [
                        (address, kind, args.images, s, start_at, n)
                        for n, s in enumerate(schedules)
                    ]
                    results = [r for part in pool.starmap(_client, jobs) for r in part]
                    if spy is not None:
                        spy.wait(60)
                    rows.append(_row(kind, rate, args, results, engine.pid, before, threads0))
                    print_table(rows[-1:], list(rows[-1]))
    finally:
        engine.terminate()
        engine.join(30)
    print(f"\nengine loop, models {args.models}, {args.clients} clients, stub "
          f"{args.stub_ms} ms, {args.seconds:g} s per rate")  # fmt: skip
    print_table(rows, list(rows[0]))
    write_json(args.out, {"environment": environment(), "args": vars(args), "rows": rows})
    return rows


def _spy(
    folder: Path | None, kind: str, rate: float, pid: int, seconds: float
) -> subprocess.Popen[bytes] | None:
    """py-spy of every engine thread (idle included) over one step, as `bench.spy_summary`
    reads it."""
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{kind}-{rate:g}.raw"
    command = ["py-spy", "record", "--threads", "--idle", "-r", "200", "-f", "raw",
               "-d", str(math.ceil(seconds)), "-o", str(out), "-p", str(pid)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _row(
    kind: str,
    rate: float,
    args: argparse.Namespace,
    results: list[tuple[str, float]],
    pid: int,
    cpu0: float,
    threads0: dict[str, float],
) -> dict[str, Any]:
    """One rate's line; CPU is over the whole step (its idle wait included: a few %)."""
    ok = sorted(ms for outcome, ms in results if outcome == "ok")
    errors = Counter(outcome for outcome, _ in results if outcome != "ok")
    threads = {k: v - threads0[k] for k, v in thread_cpu_s(pid).items()}
    answered = max(1, len(ok))
    return {
        "kind": kind,
        "rate/s": rate,
        "ok/s": round(len(ok) / args.seconds, 1),
        "p50 ms": round(percentile(ok, 50), 2),
        "p99 ms": round(percentile(ok, 99), 2),
        "mean ms": round(statistics.fmean(ok), 2) if ok else float("nan"),
        "errors": dict(errors) or "",
        "loop ms/call": round(threads["loop"] / answered * 1000, 3),
        "workers ms/call": round(threads["workers"] / answered * 1000, 3),
        "engine ms/call": round((process_cpu_s(pid) - cpu0) / answered * 1000, 3),
    }


if __name__ == "__main__":
    main()
