"""`server.client` against real servers: the service (tiny models on the CPU) for every
call, sync and async, the API key and the 404 fallback; the service with a one-item queue
for real 429s; and a small stdlib HTTP server for exact Retry-After and timeout behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from pycocotools import mask as mask_utils

from server.client import AsyncClient, Client, ServiceError, image_id_of
from tests.server.conftest import PHOTOS, ROOT, LiveServer, encode, photo_like

EVERYTHING = {"points_per_side": 4, "pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}


def test_the_client_imports_neither_torch_nor_fastapi() -> None:
    code = "import sys, server.client; print(sorted({'torch', 'fastapi'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_every_call_against_the_service(live_server: LiveServer, real_photo: bytes) -> None:
    with Client(live_server.url) as c, httpx.Client(base_url=live_server.url) as raw:
        assert c.ready()
        emb = c.embed(real_photo)
        assert emb.image_id == hashlib.sha256(real_photo).hexdigest() == image_id_of(real_photo)
        assert (emb.width, emb.height) == (800, 534)

        seg = c.click(emb.image_id, [(400, 260)], [1], return_low_res=True)
        sent = {"image_id": emb.image_id, "point_coords": [[400, 260]], "point_labels": [1]}
        body = raw.post("/v1/segment", json=sent).json()
        rle = body["results"][0]["masks"][0]["segmentation"]
        expected = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()})
        (best,) = seg.masks
        assert best.mask.dtype == np.bool_ and best.mask.shape == (534, 800)
        assert np.array_equal(best.mask, expected.astype(bool))
        assert best.area == int(best.mask.sum()) and best.low_res_handle

        refined = c.click(
            emb.image_id, [(400, 260), (150, 120)], [1, 0], mask_input=best.low_res_handle
        )
        assert refined.masks[0].mask.shape == (534, 800)

        boxes = c.segment(
            real_photo, boxes=[(70, 250, 560, 530), (10, 10, 200, 200)], multimask=True
        )
        assert [len(r) for r in boxes.results] == [3, 3]
        assert [m.score for m in boxes.results[0]] == sorted(
            (m.score for m in boxes.results[0]), reverse=True
        )

        array = c.embedding(emb.image_id)
        assert array.embedding.dtype == np.float16 and array.embedding.ndim == 4
        assert array.original_size == (534, 800)

        every = c.everything(real_photo, **EVERYTHING)
        assert every.masks and all(m.mask.shape == (534, 800) for m in every.masks)
        assert all(m.stability_score is not None and m.crop_box for m in every.masks)
        again = c.everything(image_id=emb.image_id, **EVERYTHING)
        assert len(again.masks) == len(every.masks)

        top = c.classify(real_photo, top_k=3)
        assert len(top.predictions) == 3 and top.model["name"] == "swin_test"
        assert {m["name"] for m in c.models()["models"]} == {"sam_vit_tiny", "swin_test"}


def test_errors_are_typed(live_server: LiveServer) -> None:
    with Client(live_server.url) as c:
        with pytest.raises(ServiceError) as bad:
            c.classify(b"not an image at all")
        assert (bad.value.status, bad.value.code) == (400, "bad_image")
        assert bad.value.message and bad.value.retry_after_s is None
        with pytest.raises(ServiceError) as unknown:
            c.click("0" * 64, [(1, 1)], [1])  # never sent: nothing to fall back on
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_image_id")
        with pytest.raises(ValueError, match="not both"):
            c.segment(b"bytes", image_id="0" * 64, points=[(1, 1)])
        with pytest.raises(ValueError, match="not both"):
            c.segment(points=[(1, 1)])
        with pytest.raises(ServiceError) as invalid:
            c.segment(encode(photo_like(64, 48)), box=(50, 50, 10, 10))
        assert (invalid.value.status, invalid.value.code) == (422, "invalid_request")


def test_a_forgotten_image_is_sent_again(make_server: Callable[..., LiveServer]) -> None:
    # Two pods: the embedding is cached on the first, the click lands on the second.
    first, second = make_server(), make_server()
    photo = encode(photo_like(160, 120, seed=7))
    with Client(first.url) as c:
        emb = c.embed(photo)
        c.http.base_url = httpx.URL(second.url)
        seg = c.click(emb.image_id, [(80, 60)], [1])
        assert seg.image_id == emb.image_id and seg.masks[0].mask.shape == (120, 160)
        # the second server has it now: a click by id alone succeeds there
        check = httpx.post(second.url + "/v1/embed", json={"image_id": emb.image_id})
        assert check.status_code == 200 and check.json()["cached"] is True
    with Client(second.url, remember_images=0) as forgetful:
        emb = forgetful.embed(encode(photo_like(160, 120, seed=8)))
        forgetful.http.base_url = httpx.URL(first.url)
        with pytest.raises(ServiceError, match="unknown_image_id"):
            forgetful.click(emb.image_id, [(80, 60)], [1])


def test_every_image_request_names_its_image_in_x_image_id(
    make_server: Callable[..., LiveServer],
) -> None:
    """What a proxy hashes: each request on an image carries its id as X-Image-Id, the
    404 fallback's resend included."""
    first, second = make_server(), make_server()
    seen: list[tuple[str, str, str | None]] = []

    def record(request: httpx.Request) -> None:
        seen.append((request.method, request.url.path, request.headers.get("x-image-id")))

    photo = encode(photo_like(128, 96, seed=9))
    pid = image_id_of(photo)
    http = httpx.Client(base_url=first.url, timeout=60, event_hooks={"request": [record]})
    with Client(first.url, http=http) as c:
        c.embed(photo)
        c.click(pid, [(64, 48)], [1])
        c.segment(photo, box=(10, 10, 90, 80))
        c.everything(image_id=pid, **EVERYTHING)
        c.classify(photo, top_k=1)
        c.embedding(pid)
        c.http.base_url = httpx.URL(second.url)  # a replica that never saw it: resent
        c.click(pid, [(64, 48)], [1])
        c.models()
    assert seen == [
        ("POST", "/v1/embed", pid),
        ("POST", "/v1/segment", pid),
        ("POST", "/v1/segment", pid),
        ("POST", "/v1/segment/everything", pid),
        ("POST", "/v1/classify", pid),
        ("GET", f"/v1/embeddings/{pid}", pid),
        ("POST", "/v1/segment", pid),  # 404 unknown_image_id on the second server
        ("POST", "/v1/segment", pid),  # the bytes, once
        ("GET", "/v1/models", None),
    ]


def test_the_api_key(make_server: Callable[..., LiveServer]) -> None:
    server = make_server(api_key="s3cret-key-for-tests")
    photo = encode(photo_like(96, 64))
    with Client(server.url) as anonymous, pytest.raises(ServiceError) as refused:
        anonymous.classify(photo)
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")
    with Client(server.url, api_key="s3cret-key-for-tests") as c:
        assert c.classify(photo, top_k=1).predictions


def test_async_client(live_server: LiveServer) -> None:
    photos = [encode(photo_like(128, 96, seed=s)) for s in range(4)]

    async def main() -> None:
        async with AsyncClient(live_server.url) as c:
            assert await c.ready()
            embs = await asyncio.gather(*(c.embed(p) for p in photos))
            assert [e.image_id for e in embs] == [image_id_of(p) for p in photos]
            segs = await asyncio.gather(*(c.click(e.image_id, [(64, 48)], [1]) for e in embs))
            assert all(s.masks[0].mask.shape == (96, 128) for s in segs)
            top = await c.classify(photos[0], top_k=2)
            assert len(top.predictions) == 2
            every = await c.everything(photos[1], **EVERYTHING)
            assert all(m.mask.shape == (96, 128) for m in every.masks)
            with pytest.raises(ServiceError) as unknown:
                await c.click("f" * 64, [(1, 1)], [1])
            assert unknown.value.code == "unknown_image_id"

    asyncio.run(main())


def test_real_429s_are_retried(make_server: Callable[..., LiveServer]) -> None:
    """One waiting item per stage: a burst of classify requests overflows it; every one
    succeeds after its Retry-After, and the server counted the refusals."""
    server = make_server(max_queue_size=1, max_queue_delay_ms=50.0)
    photos = [encode(photo_like(128, 96, seed=s)) for s in range(12)]

    async def main() -> list[int]:
        async with AsyncClient(server.url, max_retries=100, max_retry_wait_s=0.2) as c:
            results = await asyncio.gather(*(c.classify(p, top_k=1) for p in photos))
        return [len(r.predictions) for r in results]

    assert asyncio.run(main()) == [1] * len(photos)
    scrape = httpx.get(server.url + "/metrics").text
    full = 'serve_rejections_total{reason="queue_full"}'
    (line,) = [ln for ln in scrape.splitlines() if ln.startswith(full)]
    assert float(line.split()[-1]) > 0, "no 429 happened: the test proved nothing"


# -- exact retry and timeout behaviour, against a stdlib HTTP server ----------------------


class Scripted(http.server.ThreadingHTTPServer):
    """Answers each request with the next of `answers` (status, headers, body, delay)."""

    def __init__(self, answers: list[tuple[int, dict[str, str], dict, float]]) -> None:
        self.answers = answers
        self.seen: list[tuple[float, str]] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Scripted

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.seen.append((time.monotonic(), self.headers.get("authorization", "")))
        status, headers, body, delay = self.server.answers.pop(0)
        time.sleep(delay)
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {**headers, "content-type": "application/json"}.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the timeout test's client has gone
            self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[Callable[..., Scripted]]:
    servers: list[Scripted] = []

    def start(answers: list[tuple[int, dict[str, str], dict, float]]) -> Scripted:
        server = Scripted(answers)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


FULL = (429, {"Retry-After": "1"}, {"error": {"code": "queue_full", "message": "full"}}, 0.0)
OK = (200, {}, {"predictions": [{"label": "x", "index": 1, "score": 0.5}], "model": {},
                "timing_ms": {}}, 0.0)  # fmt: skip


def test_retry_after_is_honoured(scripted: Callable[..., Scripted]) -> None:
    server = scripted([FULL, FULL, OK])
    with Client(server.url, api_key="k") as c:
        top = c.classify(b"bytes", top_k=1)
    assert top.predictions[0].label == "x"
    times = [t for t, _ in server.seen]
    assert len(times) == 3 and all(b - a >= 0.95 for a, b in itertools.pairwise(times))
    assert {auth for _, auth in server.seen} == {"Bearer k"}


def test_retries_are_bounded(scripted: Callable[..., Scripted]) -> None:
    long_wait = (429, {"Retry-After": "100"}, FULL[2], 0.0)
    server = scripted([long_wait, long_wait, long_wait])
    started = time.monotonic()
    with (
        Client(server.url, max_retries=2, max_retry_wait_s=0.1) as c,
        pytest.raises(ServiceError) as full,
    ):
        c.classify(b"bytes")
    assert time.monotonic() - started < 5
    assert len(server.seen) == 3
    error = full.value
    assert (error.status, error.code, error.retry_after_s) == (429, "queue_full", 100)


def test_timeouts(scripted: Callable[..., Scripted]) -> None:
    server = scripted([(*OK[:3], 2.0)])
    with Client(server.url, timeout=0.3) as c, pytest.raises(httpx.TimeoutException):
        c.classify(b"bytes")


def test_the_readme_example_runs(live_server: LiveServer) -> None:
    """The README's client example, verbatim but for the URL, the photo paths and a
    coarser segment-everything grid (the CPU test model)."""
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(from server\.client import .*?)```", readme, re.S)
    code = code.replace("http://localhost:8000", live_server.url)
    code = code.replace("points_per_side=32", "points_per_side=4")
    for name in ("dog.jpg", "truck.jpg"):
        code = code.replace(f'"{name}"', repr(str(PHOTOS / name)))
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert isinstance(scope["array"], np.ndarray) and scope["labels"]
