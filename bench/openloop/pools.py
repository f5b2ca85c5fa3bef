"""Many small connection pools behind one count of slots, for hundreds of requests in flight.

httpcore's pool re-examines every connection (and, for idle ones, every connection again)
each time a request joins or leaves it: one pool of 1,000 connections cost a load process
seconds of CPU per second, and measured on a 2-core machine, one process sending 1,000
req/s to a trivial server fell to 72 ok/s with 3,500 timeouts. Pools of `SHARD` connections
keep that work small; a semaphore of all their slots queues the rest in the client, where
waiting is cheap (and counted: latency runs from the scheduled time).
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

SHARD = 32  # connections per httpx.AsyncClient


class HttpxPost:
    """One request's sender on a pooled httpx client: (status, body) as `wire.WirePost`."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        response = await self.client.post(path, content=body, headers=headers)
        return response.status_code, response.content


class ShardedPools:
    def __init__(self, url: str, size: int, timeout_s: float, headers: dict[str, str]) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, not {size}")
        n = math.ceil(size / SHARD)
        sizes = [SHARD] * (n - 1) + [size - SHARD * (n - 1)]
        self.sizes = sizes
        tls = ssl.create_default_context()  # one for all: each of its own costs ~20 ms
        self.clients = [
            httpx.AsyncClient(
                base_url=url,
                limits=httpx.Limits(max_connections=s, max_keepalive_connections=s),
                timeout=timeout_s,
                headers=headers,
                verify=tls,
            )
            for s in sizes
        ]
        # a stack of free slots, shards interleaved: a light load reuses the few connections
        # on top (most recently used), a heavy one spreads over every shard
        self._free = [k for i in range(SHARD) for k, s in enumerate(sizes) if i < s][::-1]
        self._slots = asyncio.Semaphore(size)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[HttpxPost]:
        """A sender on a client with a connection free for this request (waits for one);
        the same `post` as the wire client's (`wire.WirePool.slot`)."""
        async with self._slots:
            k = self._free.pop()
            try:
                yield HttpxPost(self.clients[k])
            finally:
                self._free.append(k)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
