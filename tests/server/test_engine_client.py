"""The frontend's engine client over real zmq sockets: every reply of many calls in flight
reaches its caller (the socket is read on the loop's readiness callback, whose edges a
send can consume), and a call to an engine that is not there ends at its deadline.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from server.domain import Image
from server.errors import ServiceError
from server.http.engine_client import DEADLINE_GRACE_S, EngineClient
from tests.server.conftest import LiveServer


def test_many_calls_in_flight_all_get_their_reply(
    live_server: LiveServer, jpeg_bytes: bytes, png_bytes: bytes
) -> None:
    """Calls sent while replies arrive: none is lost, none gets another's answer."""
    photos = [jpeg_bytes, png_bytes]

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as client:

            async def one(k: int) -> tuple[int, int]:
                files = {"image": ("p", photos[k % 2], "application/octet-stream")}
                response = await client.post(
                    "/v1/classify", files=files, data={"request": f'{{"top_k": {1 + k % 3}}}'}
                )
                assert response.status_code == 200, response.text
                return k, len(response.json()["predictions"])

            return await asyncio.gather(*(one(k) for k in range(48)))

    for k, predictions in asyncio.run(run()):
        assert predictions == 1 + k % 3  # each answer is its own call's


def test_a_call_to_a_missing_engine_ends_at_its_deadline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No engine at the address: zmq takes nothing (no peer); the call waits to send, then
    answers 504 once its deadline and the grace have passed, rather than hanging."""
    image = Image("0" * 64, 8, 8, np.zeros((8, 8, 3), dtype=np.uint8))

    async def run() -> float:
        client = EngineClient(f"ipc://{tmp_path}/nobody.sock", None)
        await client.start()
        started = time.monotonic()
        try:
            with pytest.raises(ServiceError) as caught:
                await client.classify(image, 1, deadline=time.monotonic() + 0.2)
            assert caught.value.status == 504
            return time.monotonic() - started
        finally:
            await client.close()

    elapsed = asyncio.run(run())
    assert 0.2 + DEADLINE_GRACE_S - 0.05 <= elapsed < 0.2 + DEADLINE_GRACE_S + 2.0
