"""The frontend's own entries in a response's `timing_ms`, so one response says where its
latency went at every hop (issue 19). All in ms, each an interval inside the one before:

- `frontend`: from the request reaching this frontend's app (the outermost middleware,
  `ObserveMiddleware`) until the response body is built (its JSON serialisation, tens of
  microseconds for a click, and the send come after). A client's latency minus this is the
  client's own lateness, the network and the HTTP parsing on both ends.
- `engine_rpc`: the engine call as the route waits for it: from handing it to the engine
  client until the route runs again with the result. Beside it in the frontend are
  `parse_and_decode` and `mask_encode`.
- `engine_wire`: the engine client's part of that: from pickling the call until its reply
  was read off the socket. `engine_rpc - engine_wire` is the frontend around the call: the
  pixels' shared-memory reference, and its event loop getting round to the call and to the
  reply (a busy loop shows here).
- `engine`: the engine process's time for the call, from receiving it to its reply being
  ready, when the engine's reply carries it (`Reply.timing_ms`). `engine_wire - engine` is
  pickling and the socket both ways; `engine` minus the engine's phases (`jpeg_decode` where the
  engine decoded the file, `encode`, `decode`, `classify`, `generate`) is the engine's
  event loop and dispatch.
"""

from __future__ import annotations

import time

from fastapi import Request

__all__ = ["EngineClock", "ms", "received_at"]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def received_at(request: Request, started: float) -> float:
    """When the request reached the app; `started` (the route's start) where no middleware
    stamped it."""
    stamp = request.scope.get("state", {}).get("received")
    return float(stamp) if isinstance(stamp, float) else started


class EngineClock:
    """One engine call's timings: `parts` goes to the engine client (it adds `engine_wire`
    and the reply's own, `engine`), `stop()` when the route has the result."""

    __slots__ = ("parts", "started", "stopped")

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.started = time.perf_counter()
        self.stopped = self.started

    def stop(self) -> None:
        self.stopped = time.perf_counter()

    def timing(self) -> dict[str, float]:
        """`engine_rpc`, then what the engine client measured."""
        return {"engine_rpc": ms(self.stopped - self.started), **self.parts}
