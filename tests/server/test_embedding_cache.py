"""The embedding cache: byte bound, LRU, host tier, single flight; and through HTTP:
a second request on the same image never runs the encoder, eviction gives 404."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from server.engine.cache import CacheObserver, EmbeddingCache, ImageEmbedding
from tests.server.conftest import encode, photo_like
from tests.server.test_api_errors import assert_error


class Events(CacheObserver):
    def __init__(self) -> None:
        self.events: list[str] = []

    def cache_event(self, event: str) -> None:
        self.events.append(event)


def entry(name: str, nbytes: int = 400) -> ImageEmbedding:
    return ImageEmbedding(name, torch.full((nbytes // 4,), float(len(name))), (8, 8), (8, 8))


def test_byte_bound_and_lru_order():
    events = Events()
    cache = EmbeddingCache(1000, observer=events)
    for name in ("a", "b"):
        cache.put(entry(name))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put(entry("c"))  # 1200 > 1000: the least recent (b) leaves
    assert cache.peek("b") is None and cache.peek("a") and cache.peek("c")
    assert cache.bytes_used == 800
    assert events.events.count("eviction") == 1
    cache.put(entry("huge", 4000))  # larger than the whole bound: not cached at all
    assert cache.peek("huge") is None and cache.bytes_used == 800


def test_host_tier_keeps_what_the_device_evicts():
    events = Events()
    cache = EmbeddingCache(400, host_bytes=800, observer=events)
    for name in ("a", "b", "c", "d"):
        cache.put(entry(name))
    # device holds d; host holds b and c (a fell off the host tier too)
    assert cache.peek("a") is None
    back = cache.get("b")
    assert back is not None and torch.equal(back.embedding, entry("b").embedding)
    assert cache.device_tier.entries.keys() == {"b"}
    assert "host_hit" in events.events and "host_eviction" in events.events


def test_concurrent_misses_compute_once():
    calls = 0

    async def main() -> list[tuple[ImageEmbedding, bool]]:
        cache = EmbeddingCache(10_000)

        async def compute() -> ImageEmbedding:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.05)
            return entry("x")

        return await asyncio.gather(*(cache.get_or_compute("x", compute) for _ in range(5)))

    results = asyncio.run(main())
    assert calls == 1
    assert [cached for _, cached in results].count(False) == 1


def samples(client: httpx.Client, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def encoder_items(client: httpx.Client) -> float:
    counts = samples(client, "serve_queue_wait_seconds_count")
    return counts.get((("stage", "sam_encoder"),), 0.0)


def test_second_request_skips_the_encoder_and_answers_the_same(client, jpeg_bytes):
    body = {"point_coords": [[120, 90]], "point_labels": [1], "multimask_output": True}
    image = base64.b64encode(encode(photo_like(300, 200, seed=7), "JPEG")).decode()
    first = client.post("/v1/segment", json={"image": image, **body})
    assert first.status_code == 200, first.text
    before = encoder_items(client)
    again = client.post("/v1/segment", json={"image": image, **body})  # same bytes
    by_id = client.post("/v1/segment", json={"image_id": first.json()["image_id"], **body})
    assert encoder_items(client) == before  # neither ran the encoder
    for r in (again, by_id):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == first.json()["results"]
    hits = samples(client, "serve_embedding_cache_events_total")
    assert hits[(("event", "hit"),)] >= 2


def test_eviction_respects_the_bound_and_gives_404(make_server):
    # vit_tiny embeddings are 256 x 16 x 16 fp32 = 256 KiB: room for exactly one
    server = make_server(enable_swin=False, embedding_cache_bytes=256 * 16 * 16 * 4)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ids = []
        for seed in (1, 2):
            data = encode(photo_like(160, 120, seed=seed), "PNG")
            r = c.post("/v1/embed", files={"image": ("a.png", data, "image/png")})
            assert r.status_code == 200, r.text
            ids.append(r.json()["image_id"])
        gone = c.post("/v1/segment", json={"image_id": ids[0], "box": [0, 0, 50, 50]})
        assert_error(gone, 404, "unknown_image_id")
        kept = c.post("/v1/segment", json={"image_id": ids[1], "box": [0, 0, 50, 50]})
        assert kept.status_code == 200, kept.text
        assert samples(c, "serve_embedding_cache_bytes")[(("tier", "device"),)] == 256 * 16 * 16 * 4
        assert samples(c, "serve_embedding_cache_events_total")[(("event", "eviction"),)] == 1


def test_embedding_download_as_npy(client, png_bytes):
    r = client.post("/v1/embed", files={"image": ("a.png", png_bytes, "image/png")})
    image_id = r.json()["image_id"]
    npy = client.get(f"/v1/embeddings/{image_id}")
    assert npy.status_code == 200
    assert npy.headers["content-type"] == "application/octet-stream"
    assert npy.headers["x-original-size"] == "300,200"
    array = np.load(io.BytesIO(npy.content), allow_pickle=False)
    assert array.dtype == np.float16 and array.shape == (1, 256, 16, 16)
    assert np.isfinite(array).all() and array.astype(np.float32).std() > 0
    assert_error(client.get("/v1/embeddings/" + "0" * 64), 404, "unknown_image_id")
    assert_error(client.get("/v1/embeddings/not-an-id"), 422, "invalid_request")
