"""Where each request's latency went: the server's `timing_ms` of every 200 (each hop's
interval, `server/http/timing.py`) beside the client's own measures, per request, then
percentiles of each part over a row's requests.

Nested, as the server measures them (each holds the ones below it):

    latency (client, from the scheduled time)
      lag            waiting in the client for the event loop or a connection
      http           the request on the wire and in HTTP parsing both ways, the response
                     read back: latency - lag - frontend
      frontend       the request reaching the app until the response body was built
        parse_and_decode, mask_encode, frontend_other (middleware, routing, the rest)
        engine_rpc   the engine call as the route waited for it
          rpc_loop   the frontend around the call: its event loop getting to the call
                     and to its reply, the pixels' reference
          engine_wire  the call pickled, sent, answered, its reply read
            rpc_transport  pickling and the socket both ways: engine_wire - engine
            engine   the engine process's time for the call (when its reply says)
              engine_other  its event loop and dispatch: engine - the phases
              jpeg_decode   a JPEG decoded by the engine (nvJPEG), its thread's wait included
              encode, decode, classify, generate (each holding its `_queue` wait)
            wire_other  without `engine`: engine_wire - the phases

`unaccounted` is latency - frontend (lag + http): the whole of what the server's own
clocks do not see. Each part is computed per request, and its percentiles taken over the
requests (a difference of percentiles would mean nothing); a part is absent from a row
whose responses lack what it needs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

# the engine's phases: they follow one another inside `engine`
ENGINE_PHASES = ("jpeg_decode", "encode", "decode", "classify", "generate")

# (column title, name): the text table's order, a request's life from the client inward
PARTS = (
    ("lag", "lag"),
    ("unacc", "unaccounted"),
    ("http", "http"),
    ("frontend", "frontend"),
    ("parse", "parse_and_decode"),
    ("mask enc", "mask_encode"),
    ("fe other", "frontend_other"),
    ("rpc", "engine_rpc"),
    ("rpc loop", "rpc_loop"),
    ("wire", "engine_wire"),
    ("transport", "rpc_transport"),
    ("engine", "engine"),
    ("eng other", "engine_other"),
    ("wire other", "wire_other"),
    ("jpeg", "jpeg_decode"),
    ("encode", "encode"),
    ("enc q", "encode_queue"),
    ("decode", "decode"),
    ("dec q", "decode_queue"),
    ("classify", "classify"),
    ("cls q", "classify_queue"),
    ("generate", "generate"),
)

_TIMING_KEY = b'"timing_ms":'


def timing_of(content: bytes) -> dict[str, float] | None:
    """A response body's `timing_ms`, without parsing the whole body (a segment's masks
    run to hundreds of kilobytes, and the client's CPU is part of what is measured).

    The service writes `timing_ms` last, a flat object of numbers; mask RLE text never
    holds a quote, so the last `"timing_ms":` is the top-level one. None for a body
    without one, or anything else than an object of numbers there."""
    at = content.rfind(_TIMING_KEY)
    if at < 0:
        return None
    start = at + len(_TIMING_KEY)
    end = content.find(b"}", start)
    try:
        value = json.loads(content[start : end + 1]) if end >= 0 else None
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {
        k: float(v)
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _minus(whole: float | None, *parts: float | None) -> float | None:
    if whole is None or any(p is None for p in parts):
        return None
    return whole - sum(p for p in parts if p is not None)


def parts_of(latency_ms: float, lag_ms: float, timing: dict[str, float]) -> dict[str, float]:
    """One request's parts (ms): the server's entries as they are and the remainders
    between them (see the module's docstring); a remainder only where its whole and
    every part of it were measured."""
    t = timing.get
    out: dict[str, float | None] = {"lag": lag_ms}
    out.update({name: t(name) for _, name in PARTS if name in timing})
    phases = [t(p) for p in ENGINE_PHASES if p in timing]
    out["unaccounted"] = _minus(latency_ms, t("frontend"))
    out["http"] = _minus(latency_ms, lag_ms, t("frontend"))
    front = [t(k) for k in ("parse_and_decode", "mask_encode") if k in timing]
    out["frontend_other"] = _minus(t("frontend"), t("engine_rpc"), *front)
    out["rpc_loop"] = _minus(t("engine_rpc"), t("engine_wire"))
    if "engine" in timing:
        out["rpc_transport"] = _minus(t("engine_wire"), t("engine"))
        out["engine_other"] = _minus(t("engine"), *phases)
    else:
        out["wire_other"] = _minus(t("engine_wire"), *phases) if phases else None
    return {k: v for k, v in out.items() if v is not None}


def breakdown(
    requests: Sequence[tuple[float, float, dict[str, float] | None]],
    percentile: Callable[[Sequence[float], float], float],
) -> dict[str, dict[str, float]]:
    """{part: {"p50", "p99", "n"}} over `requests` ((latency ms, lag ms, timing_ms or
    None)), in `PARTS`' order; requests without a timing add only their lag."""
    values: dict[str, list[float]] = {}
    for latency_ms, lag_ms, timing in requests:
        parts = parts_of(latency_ms, lag_ms, timing) if timing else {"lag": lag_ms}
        for name, ms in parts.items():
            values.setdefault(name, []).append(ms)
    out: dict[str, dict[str, float]] = {}
    for _, name in PARTS:
        if name in values:
            ordered = sorted(values[name])
            p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
            out[name] = {"p50": round(p50, 3), "p99": round(p99, 3), "n": len(ordered)}
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """p50/p99 ms of each part, one line per row; a part no row has is left out."""
    present = [(title, name) for title, name in PARTS if any(
        name in row.get("phases_ms", {}) for row in rows)]  # fmt: skip
    head = ["step", "kind", *(title for title, _ in present)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["step"]), str(row["kind"])]
        for _, name in present:
            q = row.get("phases_ms", {}).get(name)
            cells.append("-" if q is None else f"{_ms(q['p50'])}/{_ms(q['p99'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
