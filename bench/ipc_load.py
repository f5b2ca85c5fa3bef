"""Large replies under load between processes whose readers hold the GIL: zmq against the
service's Unix sockets (`server.wire`), with and without their 4 MiB send buffers.

On the H200 the service's clicks at 3,000/s with random weights (64 KB of noise-mask runs
a reply) collapsed through the sockets (p99 2 s) where zmq had held 39 ms; the frontends'
threads were busy with mask strings, which hold the GIL (docs/BENCHMARKS.md, issue 19's
thirty-fifth session). This stands in for that without models: `--servers` echo
processes (engines: uvloop, a thread holding the GIL 1 ms in 2 as a stage's would, a 0.2
ms switch interval) answer `--bytes` replies to `--clients` processes (frontends: uvloop,
each call sent open loop at its scheduled time, and per reply `--work-ms` of GIL-holding
work handed to a pool of 4 threads, as mask strings are). Latency is from the scheduled
send to the reply read by the client's loop.

    zmq          DEALER -> ROUTER over ipc://, as the service was until the thirty-fifth session
    unix         server.wire, each end asking for wire.SEND_BUFFER_BYTES of send buffer
    unix-small   server.wire with the kernel's default send buffer (208 KiB here)

    python -m bench.ipc_load --rate 600 --bytes 65536 --work-ms 2 --clients 3 --servers 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from bench.ipc_roundtrip import quantile, readable, socket_fd
from server import wire

MODES = ("zmq", "unix", "unix-small")
_SORTED = list(range(200_000, 0, -1))  # sorted() holds the GIL 2-3 ms over it (C code)


def hold_gil(ms: float) -> None:
    """Hold the GIL for about `ms` in C code, as pycocotools' encoder and orjson do: one
    sort of a part of the list sized for it, again until `ms` have passed."""
    part = _SORTED[: max(1, int(len(_SORTED) * min(1.0, ms / 2.5)))]
    started = time.perf_counter()
    while time.perf_counter() - started < ms / 1000:
        sorted(part)


def _stage_thread() -> None:
    """A stage's worker: the GIL held 1 ms in every 2."""
    while True:
        hold_gil(1.0)
        time.sleep(0.001)


def _run(main: Callable[[], Any]) -> Any:
    """`main()` on the loop the service's ends run on (uvloop's where installed)."""
    with asyncio.Runner(loop_factory=wire.event_loop_factory()) as runner:
        return runner.run(main())


def _server(mode: str, address: str, size: int, started: Any) -> None:
    sys.setswitchinterval(0.0002)  # the engine's (SERVE_SWITCH_INTERVAL_MS)
    if mode == "unix-small":
        wire.SEND_BUFFER_BYTES = 0
    reply = os.urandom(size)

    async def main() -> None:
        if mode == "zmq":
            loop = asyncio.get_running_loop()
            context: zmq.Context[Any] = zmq.Context()
            sock = context.socket(zmq.ROUTER)
            sock.bind(address)

            def read_all() -> None:
                while readable(sock):
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    sock.send_multipart([frames[0], frames[1], reply], zmq.NOBLOCK, copy=False)

            loop.add_reader(socket_fd(sock), read_all)
        else:

            def echo(connection: wire.Framed, frames: list[bytes]) -> None:
                connection.send([frames[0], reply])

            await wire.serve(address, lambda: wire.Framed(echo))
        threading.Thread(target=_stage_thread, daemon=True).start()
        started.set()
        await asyncio.Event().wait()

    _run(main)


def _zmq_send(sock: zmq.Socket[Any], drain: Callable[[], None], call: int) -> None:
    sock.send_multipart([call.to_bytes(8, "little"), b"x" * 1000], zmq.NOBLOCK)
    if readable(sock):  # a send may take the edge of a reply that came meanwhile
        drain()


def _wire_send(connection: wire.Framed, call: int) -> None:
    connection.send([call.to_bytes(8, "little"), b"x" * 1000])


def _client(mode: str, addresses: list[str], rate: float, seconds: float, work_ms: float,
            out: Any) -> None:  # fmt: skip
    if mode == "unix-small":
        wire.SEND_BUFFER_BYTES = 0
    pool = ThreadPoolExecutor(4)

    async def main() -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        due: dict[int, float] = {}
        waits: list[float] = []

        def answered(call: int) -> None:
            waits.append((time.perf_counter() - due.pop(call)) * 1000)
            if work_ms > 0:
                pool.submit(hold_gil, work_ms)

        senders: list[Callable[[int], None]] = []
        for address in addresses:
            if mode == "zmq":
                context: zmq.Context[Any] = zmq.Context()
                sock = context.socket(zmq.DEALER)
                sock.connect(address)

                def drain(sock: zmq.Socket[Any] = sock) -> None:
                    while readable(sock):
                        head = sock.recv_multipart(zmq.NOBLOCK, copy=False)[0]
                        answered(int.from_bytes(head.bytes, "little"))

                loop.add_reader(socket_fd(sock), drain)

                senders.append(functools.partial(_zmq_send, sock, drain))
            else:
                connection = await wire.connect(
                    address,
                    wire.Framed(lambda _, frames: answered(int.from_bytes(frames[0], "little"))),
                )
                senders.append(functools.partial(_wire_send, connection))
        await asyncio.sleep(0.3)
        calls = int(rate * seconds)
        start = time.perf_counter()
        for call in range(calls):
            at = start + call / rate
            if (wait := at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            due[call] = at
            senders[call % len(senders)](call)
        deadline = time.perf_counter() + 5.0
        while due and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        return calls, waits

    out.put(_run(main))


def run(mode: str, rate: float, seconds: float, size: int, work_ms: float, clients: int,
        servers: int) -> dict[str, Any]:  # fmt: skip
    """One mode's row: calls sent and answered, the wait's p50 / p99 / max in ms."""
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="ipc-load-") as folder:
        addresses = [f"ipc://{folder}/s{k}.sock" for k in range(servers)]
        try:
            for address in addresses:
                started = ctx.Event()
                procs.append(ctx.Process(target=_server, args=(mode, address, size, started),
                                         daemon=True))  # fmt: skip
                procs[-1].start()
                if not started.wait(30):
                    raise RuntimeError(f"a {mode} echo server did not start")
            out = ctx.Queue()
            for _ in range(clients):
                args = (mode, addresses, rate / clients, seconds, work_ms, out)
                procs.append(ctx.Process(target=_client, args=args, daemon=True))
                procs[-1].start()
            sent, waits = 0, []
            for _ in range(clients):
                calls, got = out.get(timeout=seconds + 60)
                sent += calls
                waits += got
        finally:
            for proc in procs:
                proc.kill()
                proc.join()
    waits.sort()
    pick = lambda q: round(quantile(waits, q), 2) if waits else None  # noqa: E731
    return {"mode": mode, "sent": sent, "answered": len(waits), "p50 ms": pick(0.5),
            "p99 ms": pick(0.99), "max ms": pick(1.0)}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rate", type=float, default=600.0, help="calls/s, all clients")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--bytes", type=int, default=65_536, help="each reply")
    parser.add_argument("--work-ms", type=float, default=2.0, help="GIL held a reply")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args(argv)
    rows = [run(mode, args.rate, args.seconds, args.bytes, args.work_ms, args.clients,
                args.servers) for mode in args.modes]  # fmt: skip
    print(f"{args.rate:g} calls/s, {args.bytes} B replies, {args.work_ms:g} ms of GIL a reply, "
          f"{args.clients} clients, {args.servers} servers")  # fmt: skip
    print("| transport | sent | answered | p50 ms | p99 ms | max ms |\n" + "|---" * 6 + "|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
    return rows


if __name__ == "__main__":
    main()
