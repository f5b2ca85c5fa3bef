"""A call's round trip between two processes, by transport: zmq as the service uses it, or a
plain Unix stream socket.

A click at 100/s spent about 1 ms in transport between a frontend and its engine on the
H200 hosts (docs/BENCHMARKS.md, issue 19: `engine_wire - engine`), where its pickles take a
few microseconds. Between calls 10 ms apart every thread on the way has gone to sleep, and
zmq adds two of them to each direction: the sender's I/O thread and the receiver's. This
measures what each wake-up costs on a host, with nothing else running: an echo server in
one process, a client in another, both on asyncio event loops as the service's are (the
engine's plain asyncio, the frontend's uvloop), the server reading its socket from the
loop's readiness callback as `server.engine.process` does.

    zmq   DEALER -> ROUTER over ipc://, read on the loop's readiness callback (zmq's
          descriptor signals edges: everything queued is read, and again after a send),
          as the service did until the thirty-fifth session
    unix  one stream connection, as the service's (`server.wire`; call 1 of issue 19's
          thirty-fifth session ran the bench's own copy of its framing, before wire.py)

Each call carries `--bytes` (a click's pickled call is about 1 KB, its reply 2 KB on
trained weights). Calls go one at a time, `--gaps-ms` apart (0: back to back); latency is
the client's, from send to reply read. Prints p50 / p90 / p99 in microseconds per mode and
gap.

    python -m bench.ipc_roundtrip --calls 400 --gaps-ms 10 1 0
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from server import wire

MODES = ("zmq", "unix")


@dataclass(frozen=True)
class Row:
    mode: str
    gap_ms: float
    calls: int
    p50_us: float
    p90_us: float
    p99_us: float


def readable(sock: zmq.Socket[Any]) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & int(zmq.POLLIN))  # type: ignore[arg-type]


def socket_fd(sock: zmq.Socket[Any]) -> int:
    return int(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]


# -- the echo servers (plain asyncio, as the engine's loop) -----------------------------


def _zmq_server(address: str, started: Any) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        context: zmq.Context[Any] = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)

        def read_all() -> None:
            while readable(sock):
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)

        loop.add_reader(socket_fd(sock), read_all)
        started.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _echo(connection: wire.Framed, frames: list[bytes]) -> None:
    connection.send(frames)


def _unix_server(path: str, started: Any) -> None:
    async def main() -> None:
        server = await wire.serve(path, lambda: wire.Framed(_echo))
        started.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the client (uvloop, as a frontend's) ------------------------------------------------


def quantile(ordered: list[float], q: float) -> float:
    """The value a fraction `q` of the way up `ordered` (sorted; 1.0: the largest)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _percentiles(mode: str, gap_ms: float, micros: list[float]) -> Row:
    micros.sort()
    return Row(mode, gap_ms, len(micros), round(statistics.median(micros), 1),
               round(quantile(micros, 0.9), 1), round(quantile(micros, 0.99), 1))  # fmt: skip


async def _zmq_client(address: str, calls: int, gaps_ms: list[float], size: int) -> list[Row]:
    loop = asyncio.get_running_loop()
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    waiting: list[asyncio.Future[None]] = []

    def drain() -> None:
        while readable(sock):
            sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if waiting:
                waiting.pop(0).set_result(None)

    loop.add_reader(socket_fd(sock), drain)
    payload = os.urandom(size)

    async def call() -> float:
        future = loop.create_future()
        waiting.append(future)
        started = time.perf_counter()
        sock.send_multipart([b"id", payload], zmq.NOBLOCK, copy=False)
        if readable(sock):  # a send may take the edge of a reply that came meanwhile
            drain()
        await future
        return (time.perf_counter() - started) * 1e6

    rows = await _run_gaps("zmq", call, calls, gaps_ms)
    loop.remove_reader(socket_fd(sock))
    sock.close(linger=0)
    context.term()
    return rows


async def _unix_client(path: str, calls: int, gaps_ms: list[float], size: int) -> list[Row]:
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[None]] = []

    def on_message(_: wire.Framed, frames: list[bytes]) -> None:
        if waiting:
            waiting.pop(0).set_result(None)

    connection = await wire.connect(path, wire.Framed(on_message))
    payload = os.urandom(size)

    async def call() -> float:
        future = loop.create_future()
        waiting.append(future)
        started = time.perf_counter()
        connection.send([payload])
        await future
        return (time.perf_counter() - started) * 1e6

    rows = await _run_gaps("unix", call, calls, gaps_ms)
    connection.close()
    return rows


async def _run_gaps(
    mode: str, call: Callable[[], Any], calls: int, gaps_ms: list[float]
) -> list[Row]:
    for _ in range(20):  # connections made, code paths warm
        await call()
    rows = []
    for gap in gaps_ms:
        micros = []
        for _ in range(calls):
            micros.append(await call())
            if gap > 0:
                await asyncio.sleep(gap / 1000)
        rows.append(_percentiles(mode, gap, micros))
    return rows


def measure(modes: list[str], calls: int, gaps_ms: list[float], size: int) -> list[Row]:
    """Each mode's rows, its server in a process of its own and the client in this one."""
    rows: list[Row] = []
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ipc-") as folder:
        for mode in modes:
            started = ctx.Event()
            path = os.path.join(folder, f"{mode}.sock")
            target = _zmq_server if mode == "zmq" else _unix_server
            where = f"ipc://{path}" if mode == "zmq" else path
            server = ctx.Process(target=target, args=(where, started), daemon=True)
            server.start()
            try:
                if not started.wait(30):
                    raise RuntimeError(f"the {mode} echo server did not start")
                client = _zmq_client if mode == "zmq" else _unix_client
                with asyncio.Runner(loop_factory=wire.event_loop_factory()) as runner:
                    rows += runner.run(client(where, calls, gaps_ms, size))
            finally:
                server.kill()
                server.join()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| transport | gap ms | calls | p50 us | p90 us | p99 us |", "|---" * 6 + "|"]
    lines += [f"| {r.mode} | {r.gap_ms:g} | {r.calls} | {r.p50_us} | {r.p90_us} | {r.p99_us} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--calls", type=int, default=400, help="per gap")
    parser.add_argument("--gaps-ms", nargs="+", type=float, default=[10.0, 1.0, 0.0])
    parser.add_argument("--bytes", type=int, default=1024, help="payload each way")
    args = parser.parse_args()
    print(table(measure(args.modes, args.calls, args.gaps_ms, args.bytes)), flush=True)


if __name__ == "__main__":
    main()
