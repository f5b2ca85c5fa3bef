"""The engine process: the models, their batchers and caches, behind one listening socket.

It does nothing but batching and GPU work. Frontends send calls (`server.messages`) over a
Unix socket each (`server.wire`), which this process's event loop reads; each call becomes
a task that awaits the engine (`server.engine.services`) and answers on the same
connection when done, so a click from any frontend finds the one embedding cache. Pixels
arrive as references to the frontends' shared memory (`server.engine.pixels`) and go back
to them by a release message once nothing here reads them.

Start-up (load, warm-up, the optional fidelity check) runs here, reported in every status
answer; the frontends turn that into `/readyz`. A start-up failure ends the process with
status 1, which ends the service (the supervisor exits non-zero and the pod restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from models.dynamo_import import preimport_dynamo
from models.sam import SAM_CONFIGS, CheckpointError
from models.sam2 import SAM2_CONFIGS, Sam2CheckpointError
from models.swin import SWIN_CONFIGS
from models.swin.resize_kernel import packed_supported
from server import tracing, wire
from server.domain import Image
from server.engine import jpeg
from server.engine.cuda_wait import cuda_wait_mode, set_cuda_wait
from server.engine.fidelity import FidelityError
from server.engine.gpu_memory import dump_history, memory_by_stream, record_history
from server.engine.jpeg import JpegDecoder
from server.engine.pixels import PixelMaps
from server.engine.services import Engine
from server.errors import ServiceError
from server.messages import (
    INTAKE_LAG_S,
    RELEASE,
    CancelCall,
    ClassifyCall,
    EmbedCall,
    EmbeddingFileCall,
    EverythingCall,
    Failure,
    ImageMsg,
    LookupCall,
    Reply,
    SegmentCall,
    Status,
    StatusCall,
    call_id_bytes,
    call_id_of,
    dump,
    load,
    sent_at,
)
from server.metrics import Metrics
from server.progress import StartupProgress, process_started
from server.settings import Settings

log = logging.getLogger(__name__)

FIDELITY_STEP = "checking fidelity against the fp32 model"

# The answer to a call read too late (`INTAKE_LAG_S`), pickled once
_BEHIND = dump(
    Reply(
        failure=Failure(
            429,
            "queue_full",
            f"the engine is more than {INTAKE_LAG_S:g} s behind its calls; retry shortly",
            {"Retry-After": "1"},
        )
    )
)


class EngineServer:
    """Serves calls from every frontend; `run` until `stop` is set (then drains)."""

    def __init__(self, settings: Settings, address: str, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.address = address
        self.metrics = metrics or Metrics()
        self.engine: Engine | None = None
        self.ready = False
        self.failure: str | None = None
        self.stuck: str | None = None
        self.progress: StartupProgress | None = None
        self.stop = asyncio.Event()
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        # each connected frontend by its id here (`owner`: calls, tasks and pixel slots
        # are keyed by it)
        self._peers: dict[bytes, wire.Framed] = {}
        self._owners = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        # messages waiting for this loop turn's end (`_send`), and pixel slots to give back
        # to each frontend (`_release_soon`, from any thread)
        self._outbox: list[tuple[bytes, list[Any]]] = []
        self._releases: dict[bytes, list[int]] = {}
        self._releases_lock = threading.Lock()
        self.pixels: PixelMaps | None = None
        self.jpeg: JpegDecoder | None = None  # None: the frontends decode every image
        self.jpeg_models: tuple[str, ...] = ()  # whose JPEG files come here undecoded
        self.bound = threading.Event()  # set once the socket listens (embedded mode waits)

    def log_gpu_memory(self) -> None:
        """`kill -USR2`: the caching allocator's reserve per stage's stream, to the log (on
        CUDA, once the engine is built): where the device's memory went."""
        engine = self.engine
        if engine is None or engine.device.type != "cuda":
            log.info("gpu memory by stream: no CUDA engine yet")
            return
        rows = memory_by_stream(engine.workers.streams)
        log.info("gpu memory by stream: %s", json.dumps(rows))
        if self.settings.gpu_memory_history:
            path = dump_history()
            streams = {stage: hex(s.cuda_stream) for stage, s in engine.workers.streams.items()}
            log.info("gpu memory history (torch.cuda.memory._dump_snapshot) in %s; the "
                     "stages' streams: %s", path, streams)  # fmt: skip

    # -- life cycle -------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        listening = await wire.serve(self.address, self._connected)
        self.bound.set()
        background = [
            asyncio.create_task(self._start(), name="engine-start"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
            asyncio.create_task(self._give_back(), name="pixel-releases"),
        ]
        try:
            await self.stop.wait()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self.engine is not None:
                await self.engine.close()
            if self.jpeg is not None:
                self.jpeg.close()
            self._flush()  # the last replies, queued in the drain's final turn
            listening.close()
            await self._written(deadline=time.monotonic() + 1.0)
            for peer in list(self._peers.values()):
                peer.close()

    async def _written(self, deadline: float) -> None:
        """Wait (until `deadline`) for the replies still queued in this process to reach
        the frontends' sockets: the loop ends after this, and what it holds with it."""
        while time.monotonic() < deadline and any(
            peer.queued_bytes() for peer in self._peers.values()
        ):
            await asyncio.sleep(0.005)

    async def _drain(self) -> None:
        """Finish every call in hand (the frontends stopped sending before this), within
        the drain timeout."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._tasks:
            log.warning("engine stopping with %d calls unfinished", len(self._tasks))

    async def _start(self) -> None:
        """Load, warm up, then flip ready; a failure is kept for status and stops the
        process."""
        started = time.perf_counter()
        settings, metrics = self.settings, self.metrics
        try:
            engine = Engine(settings, metrics)
            self.engine = engine
            if settings.gpu_memory_history and engine.device.type == "cuda":
                record_history(settings.gpu_memory_history)  # before any model's tensors
            self.pixels = PixelMaps(engine.device, self._release_soon)
            decode = await asyncio.to_thread(jpeg.choose, settings.jpeg_decode, engine.device)
            if decode is not None:
                self.jpeg = JpegDecoder(decode)
                self.jpeg_models = jpeg.models_for(
                    settings.jpeg_decode, packed_supported(engine.device)
                )
            # before the first step: the interpreter, torch's imports and the device's
            # initialisation, which a GPU machine's warm start spent seconds on (issue 21)
            log.info("engine: imports and %s ready (%.1fs since process start)",
                     engine.device, time.time() - process_started())  # fmt: skip
            metrics.track_engine(self.pixels.held_bytes)
            plan = engine.load_steps() + (engine.warm_steps() if settings.warmup else [])
            labels = [label for label, _ in plan]
            if settings.fidelity_check:
                labels.append(FIDELITY_STEP)
            progress = self.progress = StartupProgress(labels)
            await engine.load(progress)
            metrics.set_models(engine.models())
            engine.start()
            if settings.warmup:
                metrics.warmup_seconds.set(await engine.warmup(progress))
                for event, count in engine.compile_cache_events.items():
                    metrics.compile_cache.labels(event).set(count)
            if settings.fidelity_check:
                progress.begin(FIDELITY_STEP)
                report = await engine.check_fidelity()
                for model, measures in report.measures.items():
                    for measure, value in measures.items():
                        metrics.fidelity.labels(model, measure).set(value)
                if report.shortfalls:
                    raise FidelityError(
                        "the served variant is below the fidelity floor: "
                        + "; ".join(report.shortfalls)
                    )
            # start-up's transients (the largest decoder bucket's masks and runs, compiling,
            # capturing) go back to the device: reserved by the start-up thread's stream,
            # they would stay there unused, 23 GB on an H200 (docs/BENCHMARKS.md)
            released = await asyncio.to_thread(engine.workers.release_cached)
            log.info("start-up's cached GPU memory released: %.2f GB (the most reserved at"
                     " once during start-up: %.2f GB)", released / 1e9,
                     engine.workers.peak_reserved() / 1e9)  # fmt: skip
            self.ready = True
            metrics.ready.set(1)
            log.info("ready after %.1fs (%.1fs since process start)",
                     time.perf_counter() - started, progress.elapsed())  # fmt: skip
        except (CheckpointError, Sam2CheckpointError) as exc:
            # a wrong file: its message names the file and the problem; a traceback would
            # only bury it
            self.failure = f"start-up failed: {type(exc).__name__}: {exc}"
            log.error(self.failure)
        except Exception as exc:
            self.failure = f"start-up failed: {type(exc).__name__}: {exc}"
            log.exception("start-up failed")

    async def _give_back(self) -> None:
        """Release pixel slots as soon as their uploads finish (CUDA events, polled)."""
        while True:
            pixels = self.pixels
            busy = pixels is not None and pixels.pending
            await asyncio.sleep(0.002 if busy else 0.02)
            if pixels is not None:
                pixels.poll()

    async def _watchdog(self) -> None:
        """Report a batch that has computed for longer than the watchdog's timeout.

        A hung GPU call never returns; requests behind it fail at their deadlines, and
        /healthz turning 503 (from this, in every frontend) lets Kubernetes restart the pod.
        """
        timeout_s = self.settings.watchdog_timeout_s
        period = min(1.0, timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if self.pixels is not None:
                self.pixels.forget_gone()
            engine = self.engine
            if engine is None:
                continue
            stuck = []
            for batcher in engine.batchers():
                over = batcher.busy_for() > timeout_s
                self.metrics.worker_stuck.labels(batcher.stage).set(int(over))
                if over:
                    stuck.append(f"{batcher.stage} ({batcher.busy_for():.0f}s)")
            if stuck and not self.stuck:
                log.error("worker stuck: %s has computed one batch for over %.0fs",
                          stuck, timeout_s)  # fmt: skip
            self.stuck = ", ".join(stuck) or None

    # -- the connections ----------------------------------------------------------------

    def _connected(self) -> wire.Framed:
        """A frontend connected: its messages read on this loop as they arrive."""
        owner = next(self._owners).to_bytes(8, "little")

        def on_message(_: wire.Framed, frames: list[bytes]) -> None:
            self._receive(owner, frames, time.perf_counter())

        def on_lost(_: wire.Framed) -> None:
            self._peers.pop(owner, None)
            self._abandon(owner)

        peer = wire.Framed(on_message, on_lost)
        self._peers[owner] = peer
        return peer

    def _abandon(self, owner: bytes) -> None:
        """A frontend left: its calls are cancelled, as if it had sent a cancel for each.
        Their replies have nowhere to go, and a stop waits for the calls in hand: after a
        classify overload on an H100 the frontends drained and exited, and the engine spent
        its own drain on their orphaned queue until the supervisor killed it
        (docs/BENCHMARKS.md, the Gluon kernels in the service)."""
        orphans = [task for (who, _), task in self._tasks.items() if who == owner]
        for task in orphans:
            task.cancel()
        if orphans:
            log.info("a frontend left: %d of its calls cancelled", len(orphans))

    def _receive(self, owner: bytes, frames: list[bytes], received: float) -> None:
        call_frame, *payload = frames
        call_id = call_id_of(call_frame)
        sent = sent_at(call_frame)
        if sent is not None and time.monotonic() - sent > INTAKE_LAG_S:
            self._send(owner, [call_id_bytes(call_id), *_BEHIND])
            self.metrics.rejected("intake", "queue_full")
            return
        try:
            call = load(payload)
        except Exception:
            log.exception("an unreadable call from a frontend")
            return
        if isinstance(call, CancelCall):
            task = self._tasks.get((owner, call.call_id))
            if task is not None:
                task.cancel()
            return
        if isinstance(call, StatusCall):
            if call.pixels is not None and self.pixels is not None:
                self.pixels.map(call.pixels)
            self._send(owner, [call_id_bytes(call_id), *dump(Reply(self.status()))])
            return
        key = (owner, call_id)
        self._tasks[key] = asyncio.create_task(self._serve(owner, call_id, call, received))

    def _send(self, owner: bytes, frames: list[Any]) -> None:
        """Queue a message to frontend `owner`; it leaves at the end of this loop turn, with
        the others queued in the turn (`_flush`)."""
        if not self._outbox:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._outbox.append((owner, frames))

    def _flush(self) -> None:
        """Send what this turn queued, without blocking, in one write a frontend (under
        load a batch's replies go out together): what a gone frontend (or one that has
        left `wire.MAX_QUEUED_BYTES` unread) cannot take is dropped; nobody waits for it."""
        outbox, self._outbox = self._outbox, []
        by_owner: dict[bytes, list[list[Any]]] = {}
        for owner, frames in outbox:
            by_owner.setdefault(owner, []).append(frames)
        for owner, messages in by_owner.items():
            peer = self._peers.get(owner)
            if peer is None:
                continue  # the frontend is gone: nothing to tell
            if not peer.send_all(messages):
                log.warning("a frontend reads nothing: %d messages to it dropped", len(messages))

    def _release_soon(self, owner: bytes, slot: int) -> None:
        """Give a pixel slot back to its frontend (from any thread). The slots released
        before the loop gets to them go back in one message per frontend: a message, a
        send and a wake-up of the loop per slot were a tenth of the loop's time per
        classify call."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._releases_lock:
            first = not self._releases
            self._releases.setdefault(owner, []).append(slot)
        if first:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._send_releases)

    def _send_releases(self) -> None:
        with self._releases_lock:
            releases, self._releases = self._releases, {}
        for owner, slots in releases.items():
            self._send(owner, [RELEASE, *dump(slots)])

    async def _serve(self, owner: bytes, call_id: int, call: object, received: float) -> None:
        """Answer one call; its reply's `timing_ms["engine"]` is this process's time for it,
        from the message read off the socket to the reply ready (`server.http.timing`),
        beside the parts measured here outside the stages (`jpeg_decode`)."""
        timing: dict[str, float] = {}
        try:
            with tracing.engine_span(call):  # a child of the frontend's span, when traced
                reply = Reply(await self._dispatch(owner, call, timing))
        except ServiceError as exc:
            reply = Reply(failure=Failure.of(exc))
        except asyncio.CancelledError:
            reply = Reply(failure=Failure(499, "client_closed", "the call was cancelled"))
        except Exception as exc:
            log.exception("a %s call failed", type(call).__name__)
            reply = Reply(failure=Failure(500, "internal", f"internal error: {type(exc).__name__}"))
        finally:
            self._tasks.pop((owner, call_id), None)
        engine_ms = round((time.perf_counter() - received) * 1000, 3)
        reply = replace(reply, timing_ms={"engine": engine_ms, **timing})
        self._send(owner, [call_id_bytes(call_id), *dump(reply)])
        if self.pixels is not None:
            self.pixels.poll()

    # -- calls --------------------------------------------------------------------------

    def status(self) -> Status:
        engine = self.engine
        s = self.settings
        sam = SAM_CONFIGS.get(s.sam_model) if s.enable_sam else None
        sam2 = SAM2_CONFIGS.get(s.sam_model) if s.enable_sam else None
        swin = SWIN_CONFIGS.get(s.swin_model) if s.enable_swin else None
        sam_size = sam.image_size if sam is not None else None
        return Status(
            ready=self.ready and self.failure is None,
            failure=self.failure,
            stuck=self.stuck,
            progress=self.progress.snapshot() if self.progress is not None else None,
            models=tuple(engine.models()) if engine is not None else (),
            sam_image_size=sam2.image_size if sam2 is not None else sam_size,
            sam_square=sam2 is not None,
            swin_resize=swin.resize_size if swin is not None else None,
            jpeg_models=self.jpeg_models,
            pid=os.getpid(),
        )

    def _require(self) -> Engine:
        if not self.ready or self.engine is None:
            raise ServiceError(503, "not_ready", "the service is still loading or warming up")
        return self.engine

    async def _image(self, message: ImageMsg, owner: bytes, timing: dict[str, float]) -> Image:
        if message.jpeg:  # a file's bytes: its slot goes back once the decode has read it
            if self.jpeg is None:
                raise ServiceError(500, "internal", "a JPEG file came, but this engine "
                                   "does not decode them")  # fmt: skip
            started = time.perf_counter()
            # no local here holds the file: a failure's traceback keeps this frame, and
            # would keep the frontend's slot with it
            size = (message.height, message.width)
            tensor = await self.jpeg.submit(self._pixels(message, owner), size)
            took = time.perf_counter() - started
            self.metrics.phase("jpeg_decode").observe(took)
            timing["jpeg_decode"] = round(took * 1000, 3)
        else:
            tensor = self._pixels(message, owner)
        return Image(message.image_id, tensor, message.width, message.height)

    def _pixels(self, message: ImageMsg, owner: bytes) -> torch.Tensor:
        pixels = message.pixels
        if isinstance(pixels, np.ndarray):  # inline (the frontend's shared memory was full)
            # a copy of our own (the message's buffer is read-only), made holding the GIL:
            # numpy's copy lets it go, and getting it back behind the stage threads cost
            # the event loop milliseconds per image under load (py-spy on the H100)
            owned = bytearray(np.ascontiguousarray(pixels, dtype=np.uint8).data)
            return torch.frombuffer(owned, dtype=torch.uint8).view(pixels.shape)
        assert self.pixels is not None
        return self.pixels.tensor(pixels, owner)

    async def _dispatch(self, owner: bytes, call: object, timing: dict[str, float]) -> object:
        engine = self._require()
        if isinstance(call, SegmentCall):
            request = call.request
            if request.image is not None:
                assert isinstance(request.image, ImageMsg)
                image = await self._image(request.image, owner, timing)
                request = replace(request, image=image)
            return await engine.segment(request)
        if isinstance(call, EmbedCall):
            image = await self._image(call.image, owner, timing)
            return await engine.embed(image, call.deadline)
        if isinstance(call, ClassifyCall):
            image = await self._image(call.image, owner, timing)
            return await engine.classify(image, call.top_k, call.deadline)
        if isinstance(call, LookupCall):
            return engine.lookup(call.image_id)
        if isinstance(call, EverythingCall):
            sent = None
            if call.image is not None:
                sent = await self._image(call.image, owner, timing)
            entry, masks, phases = await engine.everything(
                sent, call.image_id, call.fields, call.output, call.deadline
            )
            height, width = entry.original_size
            return entry.image_id, width, height, masks, phases
        if isinstance(call, EmbeddingFileCall):
            return await engine.embedding_file(call.image_id)
        raise ServiceError(500, "internal", f"unknown call {type(call).__name__}")


def engine_main(settings: Settings, address: str, role: str = "engine-0") -> None:
    """An engine process's entry point (spawned by the supervisor, one per GPU: the GPU is
    the one its CUDA_VISIBLE_DEVICES names, `cuda:0` here)."""
    from server.logs import configure_logging, stacks_on_sigusr1

    configure_logging(settings.log_level, role)
    tracing.setup(role)
    sys.setswitchinterval(settings.switch_interval_ms / 1000.0)
    if settings.device != "cpu":
        # before anything makes the CUDA context: the flag is the context's
        wait = cuda_wait_mode(settings.cuda_wait)
        why_not = set_cuda_wait(wait)
        if why_not is None:
            log.info("SERVE_CUDA_WAIT=%s: %s set on the GPU's context", settings.cuda_wait, wait)
        else:
            # no driver under SERVE_DEVICE=auto is a CPU host, where nothing waits on a GPU
            quiet = settings.device == "auto" and why_not.startswith("no CUDA driver")
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "SERVE_CUDA_WAIT=%s (%s) not set: %s", settings.cuda_wait, wait, why_not,
            )  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; SIGTERM stops
    stacks_on_sigusr1()
    # torch._dynamo is imported by the first nested-tensor batch (the encoder's warm-up):
    # 7 s on the H100 machine, overlapped with the device's start and the weights' loading;
    # compiling waits for it (models/dynamo_import.py says why)
    preimport_dynamo()
    server = EngineServer(settings, address, Metrics(role))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, server.stop.set)
        loop.add_signal_handler(signal.SIGUSR2, server.log_gpu_memory)

        async def fail_fast() -> None:
            while server.failure is None:
                await asyncio.sleep(0.05)
            server.stop.set()

        watcher = asyncio.create_task(fail_fast())
        try:
            await server.run()
        finally:
            watcher.cancel()

    try:
        with asyncio.Runner(loop_factory=wire.event_loop_factory()) as runner:
            runner.run(main())
    finally:
        tracing.shutdown()  # export what is batched before the process ends
    raise SystemExit(1 if server.failure is not None else 0)
