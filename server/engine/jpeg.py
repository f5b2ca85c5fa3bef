"""JPEG files decoded by the engine, on its GPU: nvJPEG, in batches, on a thread of its own.

Why: a frontend spends half its CPU on a classify or segment request decoding the JPEG,
and the H100 machine's cores decode a photo in about 12 ms at the scale the model needs
(`python -m bench.jpeg_decode`, docs/BENCHMARKS.md), so at 2,000 photos/s eight
frontends run out of cores on decoding alone. nvJPEG on an A100/H100 decodes baseline
JPEGs in the GPU's hardware JPEG engines, batched, for about a tenth of that host time,
and leaves the pixels where the model needs them. So a frontend checks a JPEG's header
and passes the file's bytes (in its shared memory, as it would pass pixels), and the
engine decodes them here. What nvJPEG's hardware cannot take (progressive or rotated
JPEGs, other formats) the frontends still decode (`server.http.jpeg_pass`).

`SERVE_JPEG_DECODE`: `auto` decodes SAM's images here when the engine's device is CUDA and
nvJPEG works (torchvision built with it), and Swin's where its stage resizes them in
batches (`models_for` says why only then); `engine` decodes every model's and insists
(start-up fails when it cannot, and a CPU engine decodes with libjpeg-turbo itself: the
same path with a host decoder, which the CPU tests run); `frontend` never does.

Files arrive from many requests at once: the thread takes every file waiting (up to
`max_batch`) into one nvJPEG call, and a batch that fails is decoded file by file, so a
damaged file fails its own request (400) and no other.
"""

from __future__ import annotations

import asyncio
import io
import logging
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from server.errors import ServiceError
from server.imaging import decode_image
from server.threadnames import name_this_thread

log = logging.getLogger(__name__)

Decode = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
Where = Literal["auto", "engine", "frontend"]

# Baseline, 4:2:0, 16x16 pixels: what start-up decodes to check (and initialise) nvJPEG.
_PROBE_SIZE = 16


def _probe_file() -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (_PROBE_SIZE, _PROBE_SIZE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def nvjpeg_decoder(device: torch.device) -> Decode:
    """torchvision's batched nvJPEG decode to `uint8 [H, W, 3]` on `device`, ready to
    read on any stream (the decode's stream is synchronised before the tensors leave)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(files: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.cuda.device(device):
            images = decode_jpeg(list(files), mode=ImageReadMode.RGB, device=device)
            torch.cuda.current_stream(device).synchronize()
        return [image.permute(1, 2, 0) for image in images]

    return decode


def host_decoder(files: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """libjpeg-turbo in this process, whole (the frontends' own decoder, so a CPU engine
    gives the pixels a frontend would have)."""
    out = []
    for data in files:
        raw = data.numpy().tobytes()
        decoded = decode_image(raw, max_pixels=1 << 40, max_bytes=len(raw))
        out.append(torch.from_numpy(decoded.pixels))
    return out


def choose(where: Where, device: torch.device) -> Decode | None:
    """The decoder for `SERVE_JPEG_DECODE` on `device`, checked by decoding a small file;
    None: the frontends decode. `engine` raises when it cannot decode here."""
    if where == "frontend":
        return None
    if device.type != "cuda":
        return host_decoder if where == "engine" else None
    try:
        decode = nvjpeg_decoder(device)
        probe = torch.frombuffer(bytearray(_probe_file()), dtype=torch.uint8)
        (image,) = decode([probe])
        if tuple(image.shape) != (_PROBE_SIZE, _PROBE_SIZE, 3):
            shape = tuple(image.shape)
            raise RuntimeError(f"a {_PROBE_SIZE}x{_PROBE_SIZE} file decoded as {shape}")
    except Exception as exc:  # ImportError (no torchvision), or nvJPEG's own failure
        if where == "engine":
            raise RuntimeError(
                f"SERVE_JPEG_DECODE=engine, but nvJPEG cannot decode on {device}: "
                f"{type(exc).__name__}: {exc} (torchvision built with nvJPEG is needed; "
                "SERVE_JPEG_DECODE=frontend decodes in the frontends)"
            ) from exc
        log.warning("JPEG files are decoded by the frontends: nvJPEG is not usable on %s "
                    "(%s: %s)", device, type(exc).__name__, exc)  # fmt: skip
        return None
    log.info("JPEG files are decoded on %s by nvJPEG", device)
    return decode


def models_for(where: Where, swin_batched: bool) -> tuple[str, ...]:
    """Whose images the engine decodes once it can: under `auto`, SAM's, and Swin's where
    its stage pre-processes a batch in two launches (`swin_batched`, Triton on CUDA).

    Measured on one H100 (docs/BENCHMARKS.md, 2026-11-24, each comparison on one machine):
    SAM's segment requests gain (at 250/s p99 334 against 646 ms; at 300/s 239 against 97
    ok/s). Swin's classify first peaked lower (about 700 against 910 ok/s): from nvJPEG the
    stage gets whole images, and resizing them one by one held the engine's GIL. With the
    batched kernels it peaks higher (1,165 against 709 ok/s): the frontends' JPEG decode
    was their largest cost. `engine` sends both whatever the stage.
    """
    if where == "frontend":
        return ()
    return ("sam", "swin") if where == "engine" or swin_batched else ("sam",)


def _bad(exc: Exception) -> ServiceError:
    return ServiceError(400, "bad_image", f"corrupt JPEG data: {type(exc).__name__}: {exc}")


_Settled = tuple["asyncio.Future[torch.Tensor]", "torch.Tensor | Exception"]


@dataclass
class _Job:
    data: torch.Tensor  # the file's bytes (a view of a frontend's shared memory)
    size: tuple[int, int]  # (H, W) its header declares, which the pixels must have
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]


class JpegDecoder:
    """Batches files from concurrent requests into one decode call on a thread of its own
    (the call releases the GIL; the engine's event loop never waits on it)."""

    def __init__(self, decode: Decode, max_batch: int = 64) -> None:
        self._decode = decode
        self.max_batch = max_batch
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jpeg-decode", daemon=True)
        self._thread.start()
        self.files = 0  # decoded (or refused) so far

    def submit(self, data: torch.Tensor, size: tuple[int, int]) -> asyncio.Future[torch.Tensor]:
        """The future `uint8 [H, W, 3]` pixels of the file `data`; a 400 when it does not
        decode to the (H, W) its header declared. (Not a coroutine: its frame would hold
        `data` for as long as an exception's traceback lives.)"""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._jobs.put(_Job(data, size, loop, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        name_this_thread()
        while self._next_batch():
            pass

    def _next_batch(self) -> bool:
        """Wait for files and decode every one waiting; False once closed. (A function of
        its own so that no local outlives the batch: a file's bytes are a frontend's slot,
        given back only when nothing here holds them.)"""
        job = self._jobs.get()
        if job is None:
            return False
        batch = [job]
        while len(batch) < self.max_batch:
            try:
                more = self._jobs.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._jobs.put(None)
                break
            batch.append(more)
        self._decode_batch(batch)
        return True

    def _decode_batch(self, batch: list[_Job]) -> None:
        try:
            results: list[torch.Tensor | Exception] = list(self._decode([j.data for j in batch]))
        except Exception as exc:  # one damaged file fails the batch: find it, file by file
            _forget_frames(exc)
            results = [self._one(job) for job in batch]
        self.files += len(batch)
        settled: dict[asyncio.AbstractEventLoop, list[_Settled]] = {}
        for job, result in zip(batch, results, strict=True):
            if isinstance(result, torch.Tensor) and tuple(result.shape[:2]) != job.size:
                result = ServiceError(
                    400,
                    "bad_image",
                    f"the JPEG header says {job.size[1]}x{job.size[0]} but its data decode to "
                    f"{int(result.shape[1])}x{int(result.shape[0])}",
                )
            settled.setdefault(job.loop, []).append((job.future, result))
        # one wake-up of the (engine's one) loop per batch, not per file
        for loop, results_there in settled.items():
            loop.call_soon_threadsafe(_settle_all, results_there)

    def _one(self, job: _Job) -> torch.Tensor | Exception:
        try:
            (image,) = self._decode([job.data])
        except ServiceError as exc:  # the host decoder's own 400
            _forget_frames(exc)
            return ServiceError(exc.status, exc.code, exc.message)
        except Exception as exc:
            _forget_frames(exc)
            return _bad(exc)
        return image


def _forget_frames(exc: BaseException | None) -> None:
    """Clear the locals of the frames an exception (and those it chains) kept: they hold
    the files' bytes, frontends' slots that would otherwise wait for the cycle collector."""
    while exc is not None:
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


def _settle_all(settled: list[_Settled]) -> None:
    for future, result in settled:
        if future.done():  # the request was cancelled meanwhile
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
