"""Decoded pixels in shared memory: slots handed out, lent to the engine, and given back."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import numpy as np

from server.http.pixels import ALIGN, SharedPixels
from server.messages import PixelRef
from tests.conftest import PHOTOS
from tests.server.conftest import LiveServer, small_settings


def test_slots_are_first_fit_and_a_full_file_spills_to_the_heap(tmp_path):
    pixels = SharedPixels(3 * ALIGN, folder=tmp_path)
    try:
        a = pixels.empty((ALIGN // 3, 1, 3))  # one page
        b = pixels.empty((2 * ALIGN // 3, 1, 3))  # two pages: the file is full
        assert pixels.offset_of(a) == 0 and pixels.offset_of(b) == ALIGN
        spilled = pixels.empty((10, 10, 3))
        assert pixels.offset_of(spilled) is None and pixels.spilled == 1
        pixels.release_array(a)
        again = pixels.empty((5, 5, 3))  # the freed first page is reused
        assert pixels.offset_of(again) == 0
        assert pixels.held_bytes == 3 * ALIGN
    finally:
        pixels.close()
    assert not pixels.path.exists()


def test_a_slot_lent_to_the_engine_is_freed_by_its_last_holder(tmp_path):
    pixels = SharedPixels(4 * ALIGN, folder=tmp_path)
    try:
        image = pixels.empty((8, 8, 3))
        image[:] = 7
        ref = pixels.ref(image)
        assert isinstance(ref, PixelRef) and ref.shape == (8, 8, 3)
        # what the engine maps sees what the frontend wrote
        mapped = np.memmap(ref.path, dtype=np.uint8, mode="r", offset=ref.offset, shape=ref.shape)
        assert (mapped == 7).all()
        pixels.release_array(image)  # the request is done; the engine still reads
        assert pixels.slots == 1
        pixels.release(ref.slot)  # the engine's release
        assert pixels.slots == 0 and pixels.held_bytes == 0
        heap = np.zeros((2, 2, 3), dtype=np.uint8)
        assert pixels.ref(heap) is heap  # heap pixels travel inline
    finally:
        pixels.close()


def test_the_engine_unmaps_a_gone_frontends_file_once_nothing_reads_it(tmp_path):
    import gc

    import torch

    from server.engine.pixels import PixelMaps

    frontend = SharedPixels(4 * ALIGN, folder=tmp_path)
    released: list[int] = []
    maps = PixelMaps(torch.device("cpu"), lambda owner, slot: released.append(slot))
    image = frontend.empty((8, 8, 3))
    image[:] = 3
    ref = frontend.ref(image)
    assert isinstance(ref, PixelRef)
    tensor = maps.tensor(ref, b"frontend-0")
    assert int(tensor.sum()) == 3 * 8 * 8 * 3
    frontend.close()  # the supervisor removed the dead frontend's file
    maps.forget_gone()
    assert ref.path in maps._maps, "a tensor still reads it: kept"
    del tensor
    gc.collect()
    assert released == [ref.slot]
    maps.forget_gone()
    assert ref.path not in maps._maps


def test_the_engine_gives_every_slot_back_after_the_requests(make_server):
    """Through the engine's socket: a release for each image, so the file never fills."""
    server = make_server(shm_bytes_per_worker=32 * 1024**2)
    photo = (PHOTOS / "dog.jpg").read_bytes()

    def two_requests(i: int) -> tuple[int, int]:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            tail = bytes([i % 256, i // 256])  # after the JPEG's end: new bytes, new id
            files = {"image": ("d.jpg", photo + tail, "image/jpeg")}
            classified = c.post("/v1/classify", files=files)
            segmented = c.post(
                "/v1/segment", files=files, data={"request": '{"box": [10, 10, 300, 200]}'}
            )
            return classified.status_code, segmented.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert set(pool.map(two_requests, range(30))) == {(200, 200)}
    pixels = server.app.state.serve.pixels
    deadline = time.monotonic() + 10
    while pixels.slots > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pixels.slots == 0, f"{pixels.slots} slots never given back"
    assert pixels.spilled == 0


def test_two_engines_map_one_frontend_s_file_and_each_gives_its_slots_back():
    """One frontend, two engines (as with SERVE_ENGINES=2): each engine maps the frontend's
    file and releases the slots of the calls it served, over its own socket."""
    from server.engine.embedded import EmbeddedEngine
    from server.metrics import Metrics

    settings = small_settings(shm_bytes_per_worker=32 * 1024**2)
    engines = [EmbeddedEngine(settings, Metrics()) for _ in range(2)]
    for engine in engines:
        engine.start()
    server = LiveServer(settings)
    server.app.state.serve.engine_address = tuple(e.address for e in engines)
    try:
        server.start()
        photo = (PHOTOS / "dog.jpg").read_bytes()

        def two_requests(i: int) -> tuple[int, int]:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                files = {"image": ("d.jpg", photo + bytes([i]), "image/jpeg")}  # new ids
                classified = c.post("/v1/classify", files=files)
                segmented = c.post(
                    "/v1/segment", files=files, data={"request": '{"box": [10, 10, 300, 200]}'}
                )
                return classified.status_code, segmented.status_code

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert set(pool.map(two_requests, range(24))) == {(200, 200)}
        pixels = server.app.state.serve.pixels
        deadline = time.monotonic() + 10
        while pixels.slots > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pixels.slots == 0, f"{pixels.slots} slots never given back"
        assert pixels.spilled == 0
        for engine in engines:  # both served images out of the frontend's file
            assert str(pixels.path) in engine.server.pixels._maps
    finally:
        server.stop()
        for engine in engines:
            engine.stop()


def test_the_engine_maps_a_frontends_file_before_its_first_image(tmp_path):
    """The frontend names its file in its status calls, so the engine maps (on CUDA:
    page-locks, about 90 ms for 128 MiB on the H100) before any image comes, not during
    the frontend's first request. A file that cannot be mapped is said once."""
    from server.engine.embedded import EmbeddedEngine
    from server.metrics import Metrics

    settings = small_settings(shm_bytes_per_worker=32 * 1024**2)
    engine = EmbeddedEngine(settings, Metrics())
    engine.start()
    server = LiveServer(settings)
    server.app.state.serve.engine_address = (engine.address,)
    try:
        server.start()
        path = str(server.app.state.serve.pixels.path)
        maps = engine.server.pixels
        deadline = time.monotonic() + 10
        while (maps is None or path not in maps._maps) and time.monotonic() < deadline:
            time.sleep(0.05)
            maps = engine.server.pixels
        assert maps is not None and path in maps._maps, "not mapped before any image"
        assert maps._live.get(path, 0) == 0  # no image has been lent from it
        gone = str(tmp_path / "no-such-file")
        maps.map(gone)
        maps.map(gone)
        assert gone in maps._unmappable and gone not in maps._maps
    finally:
        server.stop()
        engine.stop()
