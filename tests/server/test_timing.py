"""A response's `timing_ms` accounts for its latency hop by hop (server/http/timing.py):
on segment (a photo, then clicks on its embedding), classify and embed, the frontend's,
the engine call's and the engine's intervals nest, each part inside its whole, and the
whole inside what the client measured."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable

import httpx

from tests.server.conftest import LiveServer, encode, photo_like

# rounding: every entry is rounded to a microsecond on its own
SLACK_MS = 0.01
# every hop's entry on every route that calls the engine
FRONTEND = {"engine_rpc", "engine_wire", "engine", "frontend"}


def nested(timing: dict[str, float], engine_phases: Iterable[str]) -> None:
    """engine_rpc >= engine_wire [>= engine] >= the engine's phases, added up."""
    chain = [timing[k] for k in ("engine_rpc", "engine_wire", "engine") if k in timing]
    chain.append(sum(timing[p] for p in engine_phases))
    for outer, inner in itertools.pairwise(chain):
        assert outer + SLACK_MS >= inner >= 0, timing
    for phase in engine_phases:
        queue = timing.get(f"{phase}_queue")
        assert queue is None or 0 <= queue <= timing[phase] + SLACK_MS, timing


def timed(client: httpx.Client, *args: object, **kwargs: object) -> tuple[dict, float]:
    """The response's body and the client's own clock for it, in ms."""
    started = time.perf_counter()
    r = client.post(*args, **kwargs)  # type: ignore[arg-type]
    elapsed = (time.perf_counter() - started) * 1000
    assert r.status_code == 200, r.text
    return r.json(), elapsed


def test_segment_and_click_account_for_every_hop(live_server: LiveServer) -> None:
    photo = encode(photo_like(320, 240, seed=41))
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        first = timed(
            c, "/v1/segment", files={"image": ("p.jpg", photo, "image/jpeg")},
            data={"request": json.dumps({"box": [10, 10, 200, 150]})},
        )  # fmt: skip
        clicks = [
            timed(c, "/v1/segment", json={"image_id": first[0]["image_id"],
                  "point_coords": [[40 + k, 60]], "point_labels": [1]})
            for k in range(3)
        ]  # fmt: skip
    for body, seen in [first, *clicks]:
        t = body["timing_ms"]
        assert FRONTEND | {"parse_and_decode", "encode", "decode", "mask_encode", "total"} <= set(t)
        # the client waited for all of it; the app's time holds the route's
        assert seen + SLACK_MS >= t["frontend"] >= t["total"] > 0, (seen, t)
        # the route's three parts follow one another
        parts = t["parse_and_decode"] + t["engine_rpc"] + t["mask_encode"]
        assert t["total"] + 3 * SLACK_MS >= parts, t
        nested(t, ("encode", "decode"))
    # a click's embedding is cached: no encoder queue, and the encode a look-up
    for body, _ in clicks:
        assert "encode_queue" not in body["timing_ms"]
        assert body["timing_ms"]["encode"] < body["timing_ms"]["decode"]


def test_classify_and_embed_account_for_every_hop(live_server: LiveServer) -> None:
    photo = encode(photo_like(200, 160, seed=42))
    image = {"image": ("p.jpg", photo, "image/jpeg")}
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        classified, seen = timed(
            c, "/v1/classify", files=image, data={"request": json.dumps({"top_k": 3})}
        )
        embedded, embed_seen = timed(c, "/v1/embed", files=image)
        looked_up, lookup_seen = timed(c, "/v1/embed", json={"image_id": embedded["image_id"]})
    t = classified["timing_ms"]
    assert FRONTEND | {"parse_and_decode", "classify", "classify_queue", "total"} <= set(t)
    assert seen + SLACK_MS >= t["frontend"] >= t["total"] > 0, (seen, t)
    assert t["total"] + 2 * SLACK_MS >= t["parse_and_decode"] + t["engine_rpc"], t
    nested(t, ("classify",))
    for body, client_ms, phases in (
        (embedded, embed_seen, ("encode",)),
        (looked_up, lookup_seen, ()),  # a look-up: no model work at all
    ):
        t = body["timing_ms"]
        assert set(t) >= FRONTEND, t
        assert client_ms + SLACK_MS >= t["frontend"] >= t["engine_rpc"], (client_ms, t)
        nested(t, phases)
    assert looked_up["cached"] and set(looked_up["timing_ms"]) == FRONTEND
