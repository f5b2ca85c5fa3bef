"""A lean HTTP/1.1 client for the load tool: keep-alive connections on asyncio streams.

Why not httpx: the client's own time is part of every latency the tool reports (it counts
from the scheduled time), and httpx's async stack costs about 2 ms of CPU a request. On
the 2-core development machine a POST to a FastAPI route returning 1.5 KB took 2.7 ms with
httpx and 0.75 ms with these streams, from the moment the request went out (p50 of 380 at
100/s, 2026-11-26); at thousands of requests a second that CPU also made the load
processes fall behind their schedule on the GPU host. What the service is measured with
should be as cheap as the loaders users point at it (wrk, Locust's FastHttpUser), so this
is the tool's default and httpx stays as `--client httpx` to compare.

It speaks just what the tool needs: POST with a body of known length, one request at a
time per connection, responses framed by Content-Length, chunked or the connection's close;
TLS through the `ssl` module. A connection whose exchange failed or was cancelled (a
timeout) is closed and replaced, never reused half-read.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
# an idle connection older than this is not reused: uvicorn closes keep-alive connections
# idle for 5 s (its default), and a request written into one it is closing would fail
IDLE_REUSE_S = 4.0


class WireError(ConnectionError):
    """The server's answer was not HTTP/1.1 as this client reads it."""


class WireConnection:
    """One keep-alive connection; not shared between concurrent requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.reusable = True
        self.idle_since = 0.0

    def fresh(self) -> bool:
        """Still worth a request: not closed by the server, not idle near its timeout."""
        return not self.reader.at_eof() and time.monotonic() - self.idle_since < IDLE_REUSE_S

    @classmethod
    async def open(cls, host: str, port: int, tls: ssl.SSLContext | None) -> WireConnection:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None, limit=MAX_HEADER_BYTES
        )
        return cls(reader, writer)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        """Send one request (`head` ends with the blank line) and read its whole response.
        A response cut short or one this client cannot read (a number that does not parse,
        headers past `MAX_HEADER_BYTES`) raises `WireError`, a ConnectionError, as a broken
        connection raises OSError."""
        try:
            return await self._exchange(head, body)
        except (asyncio.IncompleteReadError, ValueError, asyncio.LimitOverrunError) as exc:
            self.reusable = False
            raise WireError(f"unreadable response: {exc}") from exc

    async def _exchange(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        self.writer.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:  # no copy of a large upload just to join it to its head
            self.writer.write(body)
        await self.writer.drain()
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise WireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection" and b"close" in value.lower():
                self.reusable = False
        if parts[0] == b"HTTP/1.0":
            self.reusable = False
        if chunked:
            content = await self._chunks()
        elif length is not None:
            content = await self.reader.readexactly(length)
        else:  # framed by the connection's end
            content = await self.reader.read()
            self.reusable = False
        return status, content

    async def _chunks(self) -> bytes:
        out = bytearray()
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return bytes(out)
            out += await self.reader.readexactly(size)
            if await self.reader.readexactly(2) != b"\r\n":
                raise WireError("a chunk did not end with CRLF")

    def close(self) -> None:
        self.reusable = False
        self.writer.close()


class WirePool:
    """Up to `size` connections to one server behind a count of slots, the most recently
    used connection handed out first (a light load keeps to a few warm connections).

    `slot()` yields a `post(path, body, headers) -> (status, content)`; leaving the slot
    with an exception (a timeout's cancellation included) closes its connection."""

    def __init__(self, url: str, size: int, headers: dict[str, str]) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, not {size}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an http(s) URL with a host, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = parts.netloc.rpartition("@")[2]
        common = {"Host": host_header, **headers}
        self._common = "".join(f"{k}: {v}\r\n" for k, v in common.items())
        self.size = size
        self._idle: list[WireConnection] = []
        self._slots = asyncio.Semaphore(size)
        self.opened = 0  # connections made over the pool's life (a test counts reuse)

    def encode_head(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._common}{extra}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[WirePost]:
        async with self._slots:
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if not conn.fresh():
                    conn.close()
                    conn = None
            post = WirePost(self, conn)
            try:
                yield post
            except BaseException:
                if post.conn is not None:
                    post.conn.close()
                raise
            if post.conn is not None:
                if post.conn.reusable:
                    post.conn.idle_since = time.monotonic()
                    self._idle.append(post.conn)
                else:
                    post.conn.close()

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class WirePost:
    """A slot's sender: opens its connection on first use."""

    def __init__(self, pool: WirePool, conn: WireConnection | None) -> None:
        self.pool, self.conn = pool, conn

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        pool = self.pool
        if self.conn is None:
            self.conn = await WireConnection.open(pool.host, pool.port, pool.tls)
            pool.opened += 1
        return await self.conn.request(pool.encode_head(path, body, headers), body)
