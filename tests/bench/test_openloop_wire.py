"""bench/openloop/wire.py, the load tool's lean HTTP/1.1 client: against the real service
(its multipart and JSON bodies answered as httpx's are, one connection reused), and
against small servers that frame responses the other ways HTTP/1.1 allows (chunked,
by the connection's close) or stall (a timeout discards the connection)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from bench.openloop.kinds import RequestMaker
from bench.openloop.wire import WirePool
from bench.service_load import load_images
from server.client import Client
from tests.server.conftest import LiveServer

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def without_timing(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "timing_ms"}


def test_the_service_answers_the_wire_client_as_it_answers_httpx(
    live_server: LiveServer, small_jpeg_dir: Path
) -> None:
    """The same requests (a multipart segment upload, a JSON click, a classify upload)
    sent by both clients: the same statuses and the same results, over one connection."""
    images = load_images(small_jpeg_dir)
    with Client(live_server.url, timeout=120) as client:
        ids = tuple(client.embed(data).image_id for _, data, _, _ in images)
    maker = RequestMaker(images, ids, random.Random(3), "wire", 0)
    requests = [maker.make(kind, seq) for seq, kind in enumerate(("segment", "click", "classify"))]

    async def go() -> list[tuple[int, bytes]]:
        pool = WirePool(live_server.url, 4, {"X-Request-Timeout-Ms": "60000"})
        out = []
        for r in requests:
            async with pool.slot() as wire:
                out.append(await wire.post(r.path, r.body, r.headers))
        assert pool.opened == 1  # keep-alive: each request found the same connection
        await pool.aclose()
        return out

    wire = asyncio.run(go())
    with httpx.Client(base_url=live_server.url, timeout=120) as c:
        plain = [c.post(r.path, content=r.body, headers=r.headers) for r in requests]
    for (status, content), reference, r in zip(wire, plain, requests, strict=True):
        assert status == reference.status_code == 200, (r.path, content[:300])
        got, expected = json.loads(content), reference.json()
        assert without_timing(got) == without_timing(expected), r.path
        assert "timing_ms" in got


def serve(handler: Handler) -> Callable[[Callable[[str], Awaitable[None]]], None]:
    """Run `check(url)` against an asyncio server answering every connection with `handler`."""

    def run(check: Callable[[str], Awaitable[None]]) -> None:
        async def go() -> None:
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                await check(f"http://127.0.0.1:{port}")

        asyncio.run(go())

    return run


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    return await reader.readexactly(length)


def test_chunked_and_close_framed_responses_are_read_whole() -> None:
    """A chunked response (with an extension and a trailer) keeps its connection; a
    response framed by the connection's close is read to the end and not reused."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5;ext=1\r\nhello\r\n1\r\n \r\n" + f"{len(body):x}".encode() + b"\r\n"
                     + body + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")  # fmt: skip
        await writer.drain()
        body = await read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\nConnection: close\r\n\r\n" + body[::-1])
        await writer.drain()
        writer.close()

    async def check(url: str) -> None:
        pool = WirePool(url, 2, {})
        async with pool.slot() as wire:
            assert await wire.post("/a", b"world", {}) == (200, b"hello world")
        async with pool.slot() as wire:
            assert await wire.post("/b", b"abc", {}) == (201, b"cba")
        async with pool.slot() as wire:  # the closed one was dropped: a second connection
            assert (await wire.post("/c", b"xyz", {}))[0] == 200
        assert pool.opened == connections == 2
        await pool.aclose()

    serve(handler)(check)


def test_a_timeout_discards_its_connection_and_a_big_upload_arrives_whole() -> None:
    """A request cancelled by its timeout leaves its connection closed, not half-read in
    the pool: the next request opens another. A 3 MB body arrives byte for byte."""
    seen: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                body = await read_request(reader)
                seen.append(len(body))
                if body == b"stall":
                    await asyncio.sleep(5)
                answer = str(sum(body) % 9973).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(answer), answer))  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    big = bytes(random.Random(0).randbytes(3 * 1024 * 1024))

    async def check(url: str) -> None:
        pool = WirePool(url, 1, {})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2), pool.slot() as wire:
                await wire.post("/", b"stall", {})
        async with pool.slot() as wire:
            assert await wire.post("/", big, {}) == (200, str(sum(big) % 9973).encode())
        assert pool.opened == 2 and seen == [5, len(big)]
        await pool.aclose()

    serve(handler)(check)
