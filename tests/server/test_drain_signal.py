"""SIGTERM's handlers take no lock: a handler runs between two bytecodes of the thread it
interrupts, and a lock that code holds is never released while the handler waits on it.

A frontend hung for good that way (CI, 2026-11-24): SIGTERM arrived while a request's first
observation held prometheus_client's lock, and the drain's handler set `serve_ready`, which
takes it. Here the interrupted code is emulated by holding the metrics' own lock (the one
`Metrics.ready` takes) around the handler's call, on the same thread.
"""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn
from fastapi import FastAPI

from server.http.state import ServeState
from server.http.worker import DrainingServer
from server.metrics import Metrics
from tests.server.conftest import small_settings


@pytest.mark.timeout(20)
def test_the_frontends_sigterm_handler_returns_with_the_metrics_lock_held() -> None:
    metrics = Metrics()
    metrics.ready.set(1)  # a ready service
    state = ServeState(small_settings(), metrics, ThreadPoolExecutor(1))
    server = DrainingServer(uvicorn.Config(FastAPI()), state)

    async def main() -> None:
        with metrics._lock:  # what the interrupted code held
            server.handle_exit(signal.SIGTERM, None)
            assert state.draining and state.drain_deadline is not None  # at once
            assert metrics.registry.get_sample_value("serve_ready") == 1  # not yet
        await asyncio.sleep(0.05)  # the loop runs the rest: the metric and the drain
        assert metrics.registry.get_sample_value("serve_ready") == 0
        await asyncio.sleep(0.1)  # nothing in flight: the drain ends, uvicorn is told
        assert server.should_exit

    asyncio.run(main())
    state.decode_pool.shutdown()


@pytest.mark.timeout(20)
def test_a_second_sigterm_before_the_loop_ran_stops_at_once() -> None:
    state = ServeState(small_settings(), Metrics(), ThreadPoolExecutor(1))
    server = DrainingServer(uvicorn.Config(FastAPI()), state)

    async def main() -> None:
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)  # uvicorn's own: stop now
        assert server.should_exit

    asyncio.run(main())
    state.decode_pool.shutdown()
