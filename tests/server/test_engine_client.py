"""The frontend's engine client over real Unix sockets (`server.wire`): every reply of many
calls in flight reaches its caller, a call to an engine that is not there ends at its
deadline, a call the engine reads too late is refused at its door, and messages split or
run together on the stream arrive whole.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from server import wire
from server.domain import Image
from server.errors import ServiceError
from server.http.engine_client import DEADLINE_GRACE_S, REFRESH_WITHIN_S, EngineClient
from server.messages import (
    INTAKE_LAG_S,
    LookupCall,
    Reply,
    Status,
    StatusCall,
    call_id_bytes,
    call_id_of,
    dump,
    load,
)
from tests.server.conftest import LiveServer
from tests.server.test_http_faults import metric


def test_many_calls_in_flight_all_get_their_reply(
    live_server: LiveServer, jpeg_bytes: bytes, png_bytes: bytes
) -> None:
    """Calls sent while replies arrive: none is lost, none gets another's answer. A call the
    engine read over a second late is refused (429, `INTAKE_LAG_S`: CI's 2 cores, busy with
    another test process, once made one so) and sent again after a pause, as a client
    does; every call is answered in the end."""
    photos = [jpeg_bytes, png_bytes]

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as client:

            async def one(k: int) -> tuple[int, int]:
                files = {"image": ("p", photos[k % 2], "application/octet-stream")}
                for _ in range(10):
                    response = await client.post(
                        "/v1/classify", files=files, data={"request": f'{{"top_k": {1 + k % 3}}}'}
                    )
                    if response.status_code != 429:
                        break
                    assert response.json()["error"]["code"] == "queue_full", response.text
                    await asyncio.sleep(0.2)
                assert response.status_code == 200, response.text
                return k, len(response.json()["predictions"])

            return await asyncio.gather(*(one(k) for k in range(48)))

    for k, predictions in asyncio.run(run()):
        assert predictions == 1 + k % 3  # each answer is its own call's


def test_a_call_to_a_missing_engine_ends_at_its_deadline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No engine at the address: nothing to connect to; the call waits to send, then
    answers 504 once its deadline and the grace have passed, rather than hanging. (The
    frontend's timer also ended a 1 ms request once in CI, when a loaded engine answered
    late: tests/server/test_hostile_inputs.py expects the same code there.)"""
    image = Image("0" * 64, np.zeros((8, 8, 3), dtype=np.uint8), 8, 8)

    async def run() -> float:
        client = EngineClient(f"ipc://{tmp_path}/nobody.sock", None)
        await client.start()
        started = time.monotonic()
        try:
            with pytest.raises(ServiceError) as caught:
                await client.classify(image, 1, deadline=time.monotonic() + 0.2)
            # the code of every passed deadline, whichever side notices it
            assert (caught.value.status, caught.value.code) == (504, "deadline_exceeded")
            return time.monotonic() - started
        finally:
            await client.close()

    elapsed = asyncio.run(run())
    assert 0.2 + DEADLINE_GRACE_S - 0.05 <= elapsed < 0.2 + DEADLINE_GRACE_S + 2.0


def test_a_request_found_not_ready_asks_the_engine_again_once_for_all(
    live_server: LiveServer,
) -> None:
    """A frontend whose last status is older than the engine's readiness (another frontend
    polled sooner and /readyz said 200 through it: CI, 2026-12-07, a 503 there) asks again
    before refusing; twenty requests at once share one status call per engine."""
    address = live_server.app.state.serve.embedded.address

    async def run() -> tuple[bool, list[bool], int]:
        client = EngineClient(address, None)
        asked = 0
        ask = client._ask_status

        async def counted(link, within_s):  # type: ignore[no-untyped-def]
            nonlocal asked
            asked += within_s == REFRESH_WITHIN_S  # the refresh's, not the poll's
            await ask(link, within_s)

        client._ask_status = counted  # type: ignore[method-assign]
        await client.start()
        try:
            before = client.ready  # no status answered yet
            answers = await asyncio.gather(*(client.refresh() for _ in range(20)))
            return before, answers, asked
        finally:
            await client.close()

    before, answers, asked = asyncio.run(run())
    assert not before
    assert answers == [True] * 20
    assert asked == 1


def test_a_call_read_too_late_is_refused_at_the_door(live_server: LiveServer) -> None:
    """A work call the engine reads more than INTAKE_LAG_S after it was sent gets 429 at
    once (counted as the intake's drop); a fresh one and a status call are served."""
    address = live_server.app.state.serve.embedded.address
    before = metric(live_server.url, "serve_batch_drops_total", stage="intake",
                    reason="queue_full")  # fmt: skip

    async def run() -> None:
        replies: asyncio.Queue[list[bytes]] = asyncio.Queue()
        connection = await wire.connect(
            address, wire.Framed(lambda _, frames: replies.put_nowait(frames))
        )

        async def ask(call_id: int, call: object, sent: float | None) -> Reply:
            assert connection.send([call_id_bytes(call_id, sent), *dump(call)])
            head, *payload = await asyncio.wait_for(replies.get(), 30)
            assert call_id_of(head) == call_id
            reply: Reply = load(payload)
            return reply

        try:
            lookup = LookupCall("0" * 64)
            late = await ask(1, lookup, time.monotonic() - 2 * INTAKE_LAG_S)
            assert late.failure is not None and late.failure.status == 429
            assert late.failure.code == "queue_full"
            assert late.failure.headers == {"Retry-After": "1"}
            fresh = await ask(2, lookup, time.monotonic())  # read at once: looked up
            assert fresh.failure is not None and fresh.failure.status == 404
            status = await ask(3, StatusCall(), None)  # never refused: probes depend on it
            assert isinstance(status.value, Status) and status.value.ready
        finally:
            connection.close()

    asyncio.run(run())
    after = metric(live_server.url, "serve_batch_drops_total", stage="intake",
                   reason="queue_full")  # fmt: skip
    assert after == before + 1


def test_a_frontend_that_leaves_takes_its_calls_with_it(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls in hand from a frontend whose connection closes are cancelled: nobody reads
    their replies, and the engine's stop waited on them until the supervisor killed it."""
    server = live_server.app.state.serve.embedded.server
    address = live_server.app.state.serve.embedded.address

    async def forever(owner: bytes, call: object, timing: dict[str, float]) -> object:
        await asyncio.sleep(3600)  # a call stuck behind an overloaded queue

    monkeypatch.setattr(server, "_dispatch", forever)

    async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def run() -> None:
        before = len(server._tasks)
        connection = await wire.connect(address, wire.Framed(lambda _, frames: None))
        for call_id in range(1, 6):
            call = LookupCall("0" * 64)
            assert connection.send([call_id_bytes(call_id, time.monotonic()), *dump(call)])
        await until(lambda: len(server._tasks) == before + 5, "the calls never arrived")
        connection.close()
        await until(lambda: len(server._tasks) == before, "the calls outlived their frontend")

    asyncio.run(run())


def test_messages_split_or_run_together_on_the_stream_arrive_whole() -> None:
    """The stream has no message boundaries: a message cut into single bytes, and several
    in one write with the next one's start, each reach the handler once and whole, in
    order; frames of every size (empty, large, a memoryview) keep their bytes. What one
    `Framed` writes to a real socket is read back raw, then written to another `Framed`'s
    socket in those pieces."""
    import socket

    big = np.arange(300_000, dtype=np.uint8)
    messages: list[list[bytes | memoryview]] = [
        [b"a", b""],
        [call_id_bytes(7), *dump(Reply(value=big))],
        [b"x" * 10, memoryview(b"yz")],
    ]
    lengths = [4 * (1 + len(m)) + sum(len(bytes(f)) for f in m) for m in messages]

    async def run() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        out_end, raw_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        raw_out, in_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sender = wire.Framed(lambda _, frames: None)
        await loop.create_unix_connection(lambda: sender, sock=out_end)
        for frames in messages:
            assert sender.send(frames)
        stream = b""
        while len(stream) < sum(lengths):
            stream += await loop.sock_recv(raw_in, 1 << 20)
        got: list[list[bytes]] = []
        receiver = wire.Framed(lambda _, frames: got.append(frames))
        await loop.create_unix_connection(lambda: receiver, sock=in_end)
        raw_out.setblocking(False)
        for k in range(lengths[0]):  # the first message a byte at a time, each read alone
            await loop.sock_sendall(raw_out, stream[k : k + 1])
            await asyncio.sleep(0.002)
        assert got == [[b"a", b""]]
        await loop.sock_sendall(raw_out, stream[lengths[0] : -3])  # the second, the third's start
        await asyncio.sleep(0.05)
        await loop.sock_sendall(raw_out, stream[-3:])
        for _ in range(100):
            if len(got) == 3:
                break
            await asyncio.sleep(0.01)
        for sock in (raw_in, raw_out):
            sock.close()
        sender.close()
        receiver.close()
        return got

    got = asyncio.run(run())
    assert len(got) == 3
    head, *payload = got[1]
    assert call_id_of(head) == 7
    assert np.array_equal(load(payload).value, big)
    assert got[2] == [b"x" * 10, b"yz"]


def test_both_ends_ask_for_room_for_several_large_replies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each connection's send buffer is raised past the kernel's 208 KiB default (as far as
    net.core.wmem_max lets it), on the engine's end and the frontend's, under uvloop as the
    processes run; what a 1 MB message crossing it sends arrives whole."""
    import socket

    import uvloop

    # Linux keeps twice what is asked, asked up to net.core.wmem_max
    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    wanted = 2 * min(wire.SEND_BUFFER_BYTES, wmem_max)

    async def run() -> tuple[int, int, list[bytes]]:
        served: list[wire.Framed] = []
        got: asyncio.Queue[list[bytes]] = asyncio.Queue()

        def accepted() -> wire.Framed:
            served.append(wire.Framed(_echo))
            return served[-1]

        listening = await wire.serve(f"ipc://{tmp_path}/e.sock", accepted)
        client = await wire.connect(
            f"ipc://{tmp_path}/e.sock", wire.Framed(lambda _, frames: got.put_nowait(frames))
        )
        assert client.send([b"id", bytes(range(256)) * 4096])
        echoed = await asyncio.wait_for(got.get(), 10)
        sizes = [
            end.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            for end in (served[0], client)
        ]
        client.close()
        listening.close()
        return sizes[0], sizes[1], echoed

    engine_end, frontend_end, echoed = uvloop.run(run())
    assert engine_end == frontend_end == wanted > 212_992  # the kernel's default
    assert echoed == [b"id", bytes(range(256)) * 4096]


def test_calls_in_flight_fail_at_once_when_the_engine_s_end_closes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An engine that reads a call and then closes its end (it died): the call fails with
    503 at once, not at its deadline, and the client connects again when an engine
    listens at the address again."""
    address = f"ipc://{tmp_path}/e.sock"
    image = Image("0" * 64, np.zeros((8, 8, 3), dtype=np.uint8), 8, 8)

    async def run() -> tuple[float, int, object]:
        dying = wire.serve(address, lambda: wire.Framed(lambda peer, frames: peer.close()))
        listening = await dying
        client = EngineClient(address, None)
        await client.start()
        try:
            started = time.monotonic()
            with pytest.raises(ServiceError) as caught:
                await client.classify(image, 1, deadline=time.monotonic() + 30)
            took = time.monotonic() - started
            listening.close()
            answers = await wire.serve(address, lambda: wire.Framed(_answer_lookups))
            reply = await client.lookup("1" * 64)
            answers.close()
            return took, caught.value.status, reply
        finally:
            await client.close()

    took, status, reply = asyncio.run(run())
    assert status == 503 and took < 5
    assert reply == "found"


def _echo(peer: wire.Framed, frames: list[bytes]) -> None:
    peer.send(frames)


def _answer_lookups(peer: wire.Framed, frames: list[bytes]) -> None:
    head, *payload = frames
    if isinstance(load(payload), LookupCall):
        peer.send([call_id_bytes(call_id_of(head)), *dump(Reply(value="found"))])
