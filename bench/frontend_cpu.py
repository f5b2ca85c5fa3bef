"""CPU time one frontend process spends per request, by kind (a CPU measurement).

Issue 19's H100 runs were bound by the host's CPU: eight frontends at 100-250% each. This
runs what the supervisor runs, on the CPU: one engine process (vit_tiny and swin_test, as
the tests use; its time does not count here) and one frontend process (`frontend_main`,
the production entry point: uvloop, httptools, JSON access log into a file, multiprocess
metrics in /dev/shm, the shared pixel memory), loaded at a fixed rate by this process
with the requests of `bench.openloop` (segment: a fresh photo + one box, multipart; click:
1-2 points on an embedding cached beforehand, JSON; classify: a photo, multipart; and
`healthz`, a GET that does nothing, for the floor every request pays). A new
frontend serves each kind; the engine and its embedding cache stay.

`CPU ms/req` is the frontend's user + system time (psutil) over the measured requests,
less its idle rate (status polls, samplers) over the same wall time, per request; then
the same by thread (`loop`: the event loop's; `pool`: the decode pool and the metrics
sampler) and as user and system time, idle not taken
off. `engine ms` is the engine process's CPU per request measured the same way (idle taken
off), and by thread: its event loop (the sockets, pickles, tasks), the stage
`workers` (on the CPU their time is mostly the models' arithmetic; the loop's is not, and
is the same Python on a GPU machine), and the rest. With
random weights vit_tiny's masks are noise (tens of thousands of runs: `bytes/resp` says
how big); `--checkpoint` with synthetic weights (`python -m models.weights synthesize
vit_tiny`) gives compact masks, as trained weights do. `--profile` runs cProfile in every
thread of the frontend instead (`bench.frontend_profile`) and prints each kind's time by
step; the profiler inflates Python code, so its shares are a map, and its runs are not the
measurement. `--perf` samples the frontend with `perf record` during the measured
requests (no slowdown) and splits the CPU by library and native function: the kernel
(syscalls), libpython (all Python code), uvloop, httptools, pycocotools, ... (libzmq's
I/O threads were a group of their own until the engines' messages left zmq, issue 19's
thirty-fifth session)

    python -m bench.frontend_cpu --requests 150 --kinds healthz click classify segment
    python -m models.weights synthesize vit_tiny --dest /tmp/frontcpu/weights --steps 250 \
        --crops 32
    python -m bench.frontend_cpu --requests 150 --kinds healthz click classify segment \
        --checkpoint /tmp/frontcpu/weights/sam_vit_tiny_synthetic.pth
    python -m bench.frontend_cpu --requests 300 --kinds healthz click classify --perf
    python -m bench.frontend_cpu --requests 150 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import httpx
import psutil
from PIL import Image

from bench.common import DEFAULT_IMAGES, print_table
from bench.frontend_profile import run_frontend, steps, top_functions
from bench.openloop.kinds import KINDS, Photo, RequestMaker
from server.settings import Settings
from server.threadnames import os_thread_name

WARMUP_REQUESTS = 20
THREAD_GROUPS = ("loop", "pool", "user", "system")
ENGINE_GROUPS = ("loop", "workers", "pool")
# What the engine on 2 CPU cores keeps up with (its queue would otherwise grow all along)
RATES = {"segment": 2.5, "click": 10.0, "classify": 10.0, "healthz": 50.0}
IDLE_SECONDS = 3.0


def _photos(folder: Path) -> tuple[Photo, ...]:
    photos = []
    for path in sorted(folder.glob("*.jpg")):
        with Image.open(path) as image:
            width, height = image.size
        photos.append((path.name, path.read_bytes(), width, height))
    if not photos:
        raise SystemExit(f"no .jpg photos in {folder} (pass --images)")
    return tuple(photos)


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process `pid` (also `bench.engine_loop`'s)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds by thread group: the event loop's (the main thread), the engine's stage
    workers (`gpu-<stage>`, named by
    `server.threadnames`), the rest (the decode pool, the metrics sampler, torch's
    intra-op threads); and the process's user and system time."""
    process = psutil.Process(pid)
    groups = {"loop": 0.0, "workers": 0.0, "pool": 0.0}
    for thread in process.threads():
        name = os_thread_name(pid, thread.id)
        if name is None:
            continue  # ended meanwhile
        group = (
            "loop" if thread.id == pid
            else "workers" if name.startswith("gpu-")
            else "pool"
        )  # fmt: skip
        groups[group] += thread.user_time + thread.system_time
    times = process.cpu_times()
    return {**groups, "user": times.user, "system": times.system}


async def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url + "/readyz", timeout=1)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"the service was not ready in {timeout_s:.0f} s")


async def _embed(url: str, photos: tuple[Photo, ...]) -> tuple[str, ...]:
    async with httpx.AsyncClient(timeout=60) as client:
        for name, data, _, _ in photos:
            files = {"image": (name, data, "image/jpeg")}
            response = await client.post(url + "/v1/embed", files=files)
            response.raise_for_status()
    return tuple(hashlib.sha256(data).hexdigest() for _, data, _, _ in photos)


async def _load(
    url: str, maker: RequestMaker, kind: str, count: int, rate: float, first: int
) -> list[tuple[int, int, float]]:
    """`count` requests of `kind` at `rate`/s on a fixed schedule: (status, bytes, ms)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(seq: int) -> tuple[int, int, float]:
            started = time.perf_counter()
            if kind == "healthz":
                response = await client.get("/healthz")
            else:
                request = maker.make(kind, seq)
                response = await client.post(
                    request.path, content=request.body, headers=request.headers
                )
            return response.status_code, len(response.content), time.perf_counter() - started

        started = time.perf_counter()
        tasks = []
        for i in range(count):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(first + i)))
        return [(s, b, t * 1000) for s, b, t in await asyncio.gather(*tasks)]


def _settings(args: argparse.Namespace) -> Settings:
    """The tests' small models for the engine; the frontend's settings as deployed."""
    return Settings(
        device="cpu", sam_model=args.sam_model, swin_model="swin_test",
        sam_checkpoint=args.checkpoint, mask_rle="device", max_batch_size=4,
        classify_max_batch_size=4, batch_buckets=[1, 2, 4], max_queue_delay_ms=5.0,
        decoder_max_batch_prompts=32, log_level="INFO", jpeg_decode=args.jpeg_decode,
    )  # type: ignore[call-arg]  # fmt: skip


class Service:
    """The engine process, and one frontend process at a time, on one listening socket."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        from server.supervisor import listen

        self.settings, self.folder = settings, folder
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.address = f"ipc://{folder}/engine-0.sock"
        self.context = multiprocessing.get_context("spawn")
        from server.engine.process import engine_main

        self.engine = self.context.Process(
            target=engine_main, args=(settings, self.address, "engine-0"), name="engine-0"
        )
        self.engine.start()
        self.frontend: BaseProcess | None = None

    def start_frontend(self, profile_path: str | None) -> int:
        args = (self.settings, self.sock, (self.address,), str(self.folder / "frontend.log"))
        self.frontend = self.context.Process(
            target=run_frontend, args=(*args, profile_path), name="frontend-0"
        )
        self.frontend.start()
        assert self.frontend.pid is not None
        return self.frontend.pid

    def stop_frontend(self) -> None:
        if self.frontend is not None and self.frontend.pid is not None:
            os.kill(self.frontend.pid, signal.SIGTERM)
            self.frontend.join(60)
            self.frontend = None

    def close(self) -> None:
        self.stop_frontend()
        self.engine.terminate()
        self.engine.join(60)
        self.sock.close()


async def _measure_kind(
    service: Service, args: argparse.Namespace, kind: str, maker: RequestMaker, nth: int
) -> dict[str, Any]:
    profile_path = str(service.folder / f"{kind}.prof") if args.profile else None
    pid = service.start_frontend(profile_path)
    await _wait_ready(service.url, 600)
    if profile_path is not None:
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60.0
        while not Path(profile_path + ".on").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the frontend (pid {pid}) did not start its profiler")
            await asyncio.sleep(0.05)
    rate = args.rate or RATES[kind]
    base = nth * 1_000_000  # segment photos never repeat: a new seq range per kind
    await _load(service.url, maker, kind, WARMUP_REQUESTS, rate, base)
    engine_pid = service.engine.pid
    assert engine_pid is not None
    idle_at, idle_cpu = time.perf_counter(), process_cpu_s(pid)
    idle_engine, idle_engine_threads = process_cpu_s(engine_pid), thread_cpu_s(engine_pid)
    await asyncio.sleep(IDLE_SECONDS)
    idle_wall = time.perf_counter() - idle_at
    idle_rate = (process_cpu_s(pid) - idle_cpu) / idle_wall
    engine_idle = {k: (v - idle_engine_threads[k]) / idle_wall
                   for k, v in thread_cpu_s(engine_pid).items()}  # fmt: skip
    engine_idle["all"] = (process_cpu_s(engine_pid) - idle_engine) / idle_wall
    perf = _start_perf(pid, service.folder / f"{kind}.perf") if args.perf else None
    cpu0, wall0, threads0 = process_cpu_s(pid), time.perf_counter(), thread_cpu_s(pid)
    engine0, engine_threads0 = process_cpu_s(engine_pid), thread_cpu_s(engine_pid)
    results = await _load(service.url, maker, kind, args.requests, rate, base + 1000)
    cpu, wall = process_cpu_s(pid) - cpu0, time.perf_counter() - wall0
    engine_cpu = process_cpu_s(engine_pid) - engine0
    engine_threads = thread_cpu_s(engine_pid)
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
    threads = {k: (v - threads0[k]) / args.requests * 1000 for k, v in thread_cpu_s(pid).items()}

    def per_request(busy: float, idle: float) -> float:
        """ms per request of CPU seconds `busy` over the load, less the idle rate's share."""
        return (busy - idle * wall) / args.requests * 1000

    engine = {f"engine {k} ms": per_request(engine_threads[k] - engine_threads0[k],
                                            engine_idle[k]) for k in ENGINE_GROUPS}  # fmt: skip
    engine["engine ms"] = per_request(engine_cpu, engine_idle["all"])
    service.stop_frontend()
    statuses = sorted({s for s, _, _ in results})
    if statuses != [200]:
        raise SystemExit(f"{kind}: statuses {statuses} (see {service.folder}/frontend.log)")
    row: dict[str, Any] = {
        "kind": kind,
        "rate/s": rate,
        "CPU ms/req": (cpu - idle_rate * wall) / args.requests * 1000,
        "idle CPU %": idle_rate * 100,
        **{f"{k} ms": v for k, v in threads.items()},
        **engine,
        "bytes/resp": round(statistics.mean(b for _, b, _ in results)),
        "p50 ms": statistics.median(t for _, _, t in results),
    }
    if perf is not None:
        row["perf"] = _perf_report(service.folder / f"{kind}.perf", args.top)
    if profile_path is not None:
        row["profile"] = pstats.Stats(profile_path)
        if args.profile_out is not None:
            args.profile_out.mkdir(parents=True, exist_ok=True)
            shutil.copy(profile_path, args.profile_out / f"{kind}.prof")
    return row


def _start_perf(pid: int, path: Path) -> subprocess.Popen[bytes]:
    """`perf record` of the frontend: where its CPU goes by library and native function
    (the interpreter's share is the Python code, whatever it runs)."""
    command = ["perf", "record", "-F", "999", "-q", "-p", str(pid), "-o", str(path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the load starts
    return process


def _perf_report(path: Path, top: int) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(% by library, % by library and function) of a `perf record` file, largest first."""

    def report(sort: str, limit: int) -> list[tuple[float, str]]:
        command = ["perf", "report", "-i", str(path), "--sort", sort, "--stdio", "-q"]
        text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows = []
        for line in text.splitlines():
            share, _, what = line.strip().partition("%")
            try:
                rows.append((float(share), " ".join(what.split())))
            except ValueError:
                continue
        return rows[:limit]

    return report("dso", 20), report("dso,sym", top)


def _print_perf(rows: list[dict[str, Any]]) -> None:
    """Each kind's CPU by library and by native function, in ms per request (the shares
    of `perf record`'s samples times the measured CPU ms per request)."""
    for row in rows:
        by_dso, by_symbol = row.pop("perf")
        total = row["CPU ms/req"]
        print(f"\n{row['kind']}: {total:.2f} CPU ms/req by library (perf record)")
        print_table([{"library": w, "ms/req": p * total / 100, "%": p} for p, w in by_dso],
                    ["library", "ms/req", "%"])  # fmt: skip
        print(f"\n{row['kind']}: by function")
        print_table([{"function": w, "ms/req": p * total / 100, "%": p} for p, w in by_symbol],
                    ["function", "ms/req", "%"])  # fmt: skip


def _print_profile(rows: list[dict[str, Any]], requests: int, top: int) -> None:
    """Each kind's profiled own time by step, in ms per request and share."""
    for row in rows:
        stats: pstats.Stats = row.pop("profile")
        by_step = steps(stats)
        total = sum(by_step.values())
        print(f"\n{row['kind']}: {total / requests * 1000:.2f} profiled ms/req "
              f"(warm-up included; cProfile inflates Python code)")  # fmt: skip
        ranked = sorted(by_step.items(), key=lambda item: item[1], reverse=True)
        table = [{"step": step, "ms/req": s / requests * 1000, "%": 100 * s / total}
                 for step, s in ranked]  # fmt: skip
        print_table(table, ["step", "ms/req", "%"])
        print(f"\ntop {top} functions by own time, {row['kind']}:")
        for where, seconds in top_functions(stats, top):
            print(f"  {seconds / requests * 1000:7.3f} ms/req  {where}")


async def _run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="frontcpu-", dir="/dev/shm"))
    metrics = folder / "metrics"
    metrics.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)  # the children's, as deployed
    photos = _photos(args.images)
    service = Service(_settings(args), folder)
    try:
        service.start_frontend(None)
        await _wait_ready(service.url, 600)
        image_ids = await _embed(service.url, photos)
        service.stop_frontend()
        maker = RequestMaker(photos, image_ids, random.Random(args.seed), f"{time.time()}", 0)
        rows = [
            await _measure_kind(service, args, kind, maker, n) for n, kind in enumerate(args.kinds)
        ]
    finally:
        service.close()
        shutil.rmtree(folder, ignore_errors=True)
    weights = "synthetic" if args.checkpoint else "random"
    python = sys.version.split()[0]
    print(f"\nfrontend CPU per request, SAM {args.sam_model}, {weights} weights, "
          f"{args.requests} requests per kind, {psutil.cpu_count()} cores, "
          f"Python {python}")  # fmt: skip
    profiled = args.profile
    print_table(
        [{k: v for k, v in row.items() if k not in ("profile", "perf")} for row in rows],
        [
            "kind",
            "rate/s",
            "CPU ms/req",
            *[f"{k} ms" for k in THREAD_GROUPS],
            "idle CPU %",
            "engine ms",
            *[f"engine {k} ms" for k in ENGINE_GROUPS],
            "bytes/resp",
            "p50 ms",
        ],
    )
    if args.perf:
        _print_perf(rows)
    if profiled:
        _print_profile(rows, args.requests + WARMUP_REQUESTS, args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=[*KINDS, "healthz"])
    p.add_argument("--requests", type=int, default=300, help="measured requests per kind")
    p.add_argument("--rate", type=float, default=None, help=f"requests/s (default {RATES})")
    p.add_argument("--sam-model", default="vit_tiny", help="vit_b: masks of vit_b's detail")
    p.add_argument("--checkpoint", type=Path, default=None, help="SAM vit_tiny weights")
    p.add_argument(
        "--jpeg-decode",
        default="auto",
        choices=["auto", "engine", "frontend"],
        help="SERVE_JPEG_DECODE; engine: the frontend passes JPEGs on, as on a GPU host",
    )
    p.add_argument("--perf", action="store_true", help="perf record: CPU by library")
    p.add_argument("--profile", action="store_true", help="cProfile by step instead")
    p.add_argument("--profile-out", type=Path, default=None, help="keep <kind>.prof here")
    p.add_argument("--top", type=int, default=25, help="functions listed with --profile")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
