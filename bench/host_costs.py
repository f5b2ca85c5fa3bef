"""What one segment request costs the host, piece by piece, on this machine's CPU.

Under load on the GPU the service is bound by host work sharing one GIL (docs/BENCHMARKS.md),
so these per-request costs set its ceiling: decoding the JPEG, writing each mask's COCO
counts string, and rendering the JSON body. Masks come in two kinds: a smooth object mask
(what trained weights give) and a noise-like one with as many runs as random weights give
(about 165,000 for a 2048x1365 photo). `ms` is the median over `--iters` calls in one
thread, nothing else running; `GIL ms` is how long a call keeps other Python threads
(the event loop, the GPU worker) from running, which is what bounds the service. Parsing
a multipart upload runs on the event loop itself.

    python -m bench.host_costs --iters 20
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from PIL import Image
from pycocotools import mask as mask_utils
from starlette.datastructures import UploadFile
from starlette.requests import Request

from bench.common import DEFAULT_IMAGES, environment, host_time_ms, print_table
from server.http.multipart import boundary_of, read_form
from server.imaging import decode_image
from server.messages import dump, load
from server.rle import MaskRuns, counts_string
from server.wire import Framed, framed


def numpy_counts_string(counts: np.ndarray) -> str:
    """The vectorised numpy writer the service used before pycocotools' C writer, kept here
    as the comparison: deltas from the count two back, 5 bits a character, offset 48."""
    x = np.asarray(counts, dtype=np.int64).copy()
    if x.size > 3:
        x[3:] -= np.asarray(counts, dtype=np.int64)[1:-2]
    chars = np.zeros((x.size, 13), dtype=np.uint8)
    valid = np.zeros((x.size, 13), dtype=bool)
    active = np.ones(x.size, dtype=bool)
    for j in range(13):
        c = x & 0x1F
        x >>= 5
        more = np.where(c & 0x10, x != -1, x != 0)
        chars[:, j] = (c | (more.astype(np.int64) << 5)) + 48
        valid[:, j] = active
        active &= more
        if not active.any():
            break
    return chars[valid].tobytes().decode("ascii")


def column_runs(mask: np.ndarray) -> np.ndarray:
    """COCO run lengths of a bool `[H, W]` mask (column-major, starting with zeros)."""
    flat = mask.T.reshape(-1)
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    runs = np.diff(np.concatenate(([0], changes, [flat.size])))
    return np.concatenate(([0], runs)) if flat[0] else runs


def smooth_mask(height: int, width: int) -> np.ndarray:
    ys, xs = np.ogrid[:height, :width]
    return ((ys - height / 2) / (height / 3)) ** 2 + ((xs - width / 2) / (width / 4)) ** 2 < 1


def noise_mask(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Alternating runs of 1 to 33 pixels down the columns: ~165,000 runs at 2048x1365."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 34, size=height * width // 8)
    bits = np.repeat(np.arange(lengths.size) % 2 == 1, lengths)[: height * width]
    return bits.reshape(width, height).T.copy()


def segment_body(masks: list[np.ndarray]) -> dict[str, Any]:
    """A segment response as the service writes it, one box with three masks."""
    h, w = masks[0].shape
    objects = [
        {
            "segmentation": {"size": [h, w], "counts": counts_string(column_runs(m))},
            "score": 0.91,
            "area": int(m.sum()),
            "bbox": [1.0, 2.0, 300.0, 400.0],
        }
        for m in masks
    ]
    return {
        "model": {"name": "sam_vit_b", "precision": "bf16"},
        "image": {"image_id": "0" * 64, "width": w, "height": h},
        "results": [{"masks": objects}],
        "timing_ms": {"encode": 12.5, "decode": 3.25},
    }


def runs_crossing(runs: MaskRuns) -> tuple[int, Callable[[], object]]:
    """The bytes of masks' runs as an engine sends them (`server.messages.dump` of a
    `MaskRuns`, framed as `server.wire` frames it), and a call that receives and unpickles
    them as a frontend does (`Framed.data_received` on the whole message, then `load`)."""
    frames = [memoryview(f).cast("B") for f in dump(runs)]
    message = b"".join(bytes(part) for part in framed([frames]))
    got: list[list[bytes]] = []
    end = Framed(lambda _, received: got.append(received))

    def receive() -> object:
        got.clear()
        end.data_received(message)
        return load(got[0])

    return len(message), receive


def gil_held_ms(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds a call keeps a pure-Python thread from running, on average.

    A thread counts in a Python loop, alone and then while `fn` runs `iters` times in this
    thread; what it loses is the time `fn` held the GIL (native code that releases it
    costs nothing, Python code and native code that keeps it cost their time). The GIL
    changes hands every 0.1 ms meanwhile, and the counting thread needs a core of its own.
    """
    counted: list[int] = []
    stop = threading.Event()

    def count() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        counted.append(n)

    def rate(work: Callable[[], None]) -> tuple[float, float]:
        stop.clear()
        thread = threading.Thread(target=count)
        started = time.perf_counter()
        thread.start()
        work()
        stop.set()
        thread.join()
        elapsed = time.perf_counter() - started
        return counted[-1] / elapsed, elapsed

    def calls() -> None:
        for _ in range(iters):
            fn()

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        fn()
        alone, _ = rate(lambda: time.sleep(0.5))
        beside, elapsed = rate(calls)
    finally:
        sys.setswitchinterval(before)
    return max(0.0, 1.0 - beside / alone) * elapsed / iters * 1000


def measure(step: str, fn: Callable[[], object], iters: int) -> dict[str, Any]:
    return {"step": step, "ms": host_time_ms(fn, iters), "GIL ms": gil_held_ms(fn, iters)}


def starlette_json(body: dict[str, Any]) -> bytes:
    """What Starlette's JSONResponse renders (the service's responses before orjson)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def multipart_body(photo: bytes) -> tuple[bytes, str]:
    """A segment request as curl or httpx sends it: the photo and a request part."""
    request = httpx.Request(
        "POST", "http://service/v1/segment",
        files={"image": ("photo.jpg", photo, "image/jpeg")},
        data={"request": '{"box": [10, 20, 300, 400]}'},
    )  # fmt: skip
    return request.read(), request.headers["content-type"]


def starlette_form(loop: asyncio.AbstractEventLoop, body: bytes, content_type: str) -> bytes:
    """Starlette's multipart parser, as the service read uploads before server.http.multipart,
    on one long-lived event loop (as the service's)."""

    async def parse() -> bytes:
        chunks = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])

        async def receive() -> dict[str, object]:
            chunk = next(chunks, b"")
            return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

        headers = [(b"content-type", content_type.encode("latin-1"))]
        scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
        form = await Request(scope, receive).form(max_files=4, max_fields=8)
        image = form["image"]
        assert isinstance(image, UploadFile)
        data = await image.read()
        await form.close()
        return data

    return loop.run_until_complete(parse())


def our_form(body: bytes, content_type: str) -> bytes:
    boundary = boundary_of(content_type)
    assert boundary is not None
    parts = read_form(body, boundary, 12)
    assert parts is not None
    return next(part.data for part in parts if part.name == "image")


def pillow_decode(data: bytes) -> np.ndarray:
    """Pillow's decode as the service did it before simplejpeg: load, then copy out."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return np.array(image.convert("RGB"))  # a writable copy, as a decode gives


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    print(environment(), flush=True)
    n = args.iters
    service_decode = partial(decode_image, max_pixels=40_000_000, max_bytes=50 << 20)
    rows: list[dict[str, Any]] = []
    for path in sorted(args.images.glob("*.jpg")):
        data = path.read_bytes()
        decoded = service_decode(data)
        label = f"decode {path.name} ({decoded.width * decoded.height / 1e6:.1f} MP)"
        rows.append(measure(f"{label}: Pillow (before)", partial(pillow_decode, data), n))
        rows.append(measure(f"{label}: service (now)", partial(service_decode, data), n))
    # uploads: the largest test photo, and phone-photo sizes (over Starlette's 1 MB
    # in-memory limit, its parser spools the file to disk through a thread)
    photo = max(sorted(args.images.glob("*.jpg")), key=lambda path: path.stat().st_size)
    uploads = [(photo.name, photo.read_bytes())]
    rng = np.random.default_rng(0)
    uploads += [(f"{mb} MB of bytes", rng.bytes(int(mb * 1e6))) for mb in (1.5, 4)]
    loop = asyncio.new_event_loop()
    for name, upload in uploads:
        body, content_type = multipart_body(upload)
        assert starlette_form(loop, body, content_type) == our_form(body, content_type)
        label = f"multipart upload, {name} ({len(body) / 1024:,.0f} KB)"
        before = partial(starlette_form, loop, body, content_type)
        rows.append(measure(f"{label}: Starlette (before)", before, n))
        now = partial(our_form, body, content_type)
        rows.append(measure(f"{label}: server.http.multipart (now)", now, n))

    height, width = 1365, 2048
    for kind, mask in (
        ("smooth", smooth_mask(height, width)),
        ("noise", noise_mask(height, width)),
    ):
        runs = column_runs(mask)
        assert counts_string(runs) == numpy_counts_string(runs)
        fortran = np.asfortranarray(mask[:, :, None].astype(np.uint8))
        response = segment_body([mask, mask, mask])
        size_kb = len(orjson.dumps(response)) / 1024
        label = f"{kind} mask, {runs.size:,} runs"
        steps: list[tuple[str, Callable[[], object]]] = [
            (f"{label}: pycocotools encode (full mask)", partial(mask_utils.encode, fortran)),
            (f"{label}: counts string, numpy (before)", partial(numpy_counts_string, runs)),
            (f"{label}: counts string, pycocotools C (now)", partial(counts_string, runs)),
            (
                f"{kind} body, 3 masks ({size_kb:,.0f} KB): json.dumps (before)",
                partial(starlette_json, response),
            ),
            (f"{kind} body, 3 masks: orjson (now)", partial(orjson.dumps, response)),
        ]
        # the runs on their way from the engine: int64 until 2026-11-30, then the narrowest
        # unsigned type that holds them (server.engine.runs._counts, SERVE_MASK_STRINGS=host),
        # now COCO's string written on the GPU (SERVE_MASK_STRINGS=device, auto's choice)
        narrow = runs.astype(np.uint16 if runs.max() <= 0xFFFF else np.uint32)
        area, box = np.ones(1), np.zeros((1, 4))
        for name, crossing in (
            ("int64 (before)", MaskRuns((height, width), [runs.astype(np.int64)], area, box)),
            (narrow.dtype.name + " (host strings)", MaskRuns((height, width), [narrow], area, box)),
            ("the string (now)", MaskRuns((height, width), None, area, box, [counts_string(runs)])),
        ):
            size, receive = runs_crossing(crossing)
            steps.append((f"{label}: runs to a frontend, {size / 1024:,.0f} KB {name}", receive))
        rows += [measure(step, fn, n) for step, fn in steps]
    print_table(rows, ["step", "ms", "GIL ms"])


if __name__ == "__main__":
    main()
