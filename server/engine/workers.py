"""The engine's GPU worker threads: one per stage, each with its own CUDA stream, or one.

With a single worker, a click's decoder batch queued behind an encoder batch waited for it
on the host and again on the GPU (one stream runs in order): under a mix of segment and
click load, the decoder's 5 ms batches took 38 to 41 ms (H100, docs/BENCHMARKS.md). With a
thread and a stream per stage the GPU interleaves them; the decoder's and the classifier's
streams have a higher priority than the encoder's, so their short kernels are scheduled
first whenever the encoder's leave room; the decoder's is the highest, since a click is what
a user waits on and its batches are the shortest (a classify batch of 64 photos is not).

What crosses between stages (an image's embedding, encoded on one stream and decoded on
another) is handed over only once complete: every batch function waits for its own
stream before its results are returned (`handed_over`). The encoder thus gives up starting
its next batch while the GPU finishes this one (it did before, on one stream), but no
consumer can read an unfinished embedding, and no tensor is freed while another stream
still reads it, without events and `record_stream` threaded through the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

from server.threadnames import name_this_thread

__all__ = ["CONFINED", "STAGES", "StageWorkers"]

T = TypeVar("T")
log = logging.getLogger(__name__)

# every kind of GPU work the engine does, with its stream's priority (lower runs first)
# (PyTorch's streams take priorities 0 to -3 and clamp the rest)
STAGES: dict[str, int] = {"sam_encoder": 0, "sam_decoder": -2, "swin": -1, "everything": 0}
# the stages of long batches that SERVE_ENCODER_SMS keeps to a share of the SMs
CONFINED = ("sam_encoder", "everything")


def _bind(stream: torch.cuda.Stream | None) -> None:
    """A worker thread's initializer: its current stream is the stage's for good (the
    current stream is per thread in PyTorch), and the OS knows it by its stage's name."""
    name_this_thread()
    if stream is not None:
        torch.cuda.set_stream(stream)


class StageWorkers:
    """The executor of each stage: its own thread (and stream) or one shared by all."""

    def __init__(self, device: torch.device, mode: str = "auto", encoder_sms: int = 0) -> None:
        self.device = device
        self.per_stage = mode == "per_stage" or (mode == "auto" and device.type == "cuda")
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.encoder_sms = 0  # the SMs the confined stages' green context has (0: all)
        self._green: Any = None  # the green context, kept alive as long as its streams
        if encoder_sms:
            self._green = self._confine(encoder_sms)
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._spans_broken = False  # set when reading a span failed (`handed_over`)
        if not self.per_stage:
            one = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="gpu-worker", initializer=name_this_thread
            )
            self._executors = dict.fromkeys(STAGES, one)
            return
        for stage, priority in STAGES.items():
            stream = None
            if device.type == "cuda" and self._green is not None and stage in CONFINED:
                stream = self.streams[stage] = self._green.Stream()
            elif device.type == "cuda":
                stream = self.streams[stage] = torch.cuda.Stream(device, priority=priority)
            self._executors[stage] = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"gpu-{stage}",
                initializer=_bind,
                initargs=(stream,),
            )

    def _confine(self, sms: int) -> Any:
        """A CUDA green context of `sms` SMs for the encoder stages' streams (`CONFINED`).

        Why: a stream's priority orders the blocks waiting for an SM but frees none, so a
        click's decoder kernels waited for encoder blocks to end: a decoder batch took
        6-7 ms beside graphed encoders against 2.0 alone, and 6.9 ms in the service's mix.
        With five processes' encoders confined to 96 of an H200's 132 SMs the same batch
        took 3.0-3.3 ms, and the encoders gave up a fifth of their rate (bench
        `mps_priority`, docs/BENCHMARKS.md issue 19, twenty-sixth session); in the service's
        mix at 96 SMs every path's p99 fell 9-15%. The engines' contexts take the same SMs
        (CUDA picks them; five processes' contexts together left the probe its SMs), so the
        rest stay free for decoder and classifier kernels whichever engine sends them.
        Under MPS a green context keeps to its SMs while CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
        is unset."""
        where = f"SERVE_ENCODER_SMS={sms}"
        if self.device.type != "cuda" or not self.per_stage:
            raise ValueError(
                f"{where}: confining the encoders to SMs needs a CUDA device and a stream per "
                "stage (SERVE_STAGE_THREADS=auto or per_stage); set SERVE_ENCODER_SMS=0"
            )
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).multi_processor_count
        if sms >= total:
            raise ValueError(f"{where}: this GPU has {total} SMs; give fewer, or 0 for all")
        try:
            from torch.cuda import green_contexts

            make: Any = green_contexts.GreenContext.create
            try:  # keywords only from torch 2.13; 2.11's binding takes them by position
                context = make(num_sms=sms, device_id=index)
            except TypeError:
                context = make(sms, index)
        except (ImportError, RuntimeError) as exc:  # no green contexts in this torch/driver
            raise ValueError(f"{where}: CUDA green contexts are unavailable here: {exc}") from exc
        self.encoder_sms = sms
        log.info("encoder stages confined to %d of the GPU's %d SMs", sms, total)
        return context

    def __getitem__(self, stage: str) -> ThreadPoolExecutor:
        return self._executors[stage]

    def on_stream(self, stage: str) -> AbstractContextManager[object]:
        """The stage's stream as the calling thread's current one, for warm-up (which runs
        every stage on one thread): the CUDA graphs it captures then keep the stage's
        priority. A graph's kernels run at the priority of the stream they were captured
        on, whatever stream replays them: a decoder graph captured on a stream of the
        lowest priority took 169 ms a batch beside five processes' encoders, captured on
        one of the highest 7.1 ms (2.0 alone; H100, `bench/mps_priority.py`); in the
        service's mix a decoder batch's GPU time fell from 13.6 to 9.2 ms (docs/BENCHMARKS.md
        issue 19, twenty-fifth session). A no-op without a stream of the stage's own; a name
        that is no stage is an error, not a silent no-op (warm-up's names are checked on
        the CPU, where no stage has a stream)."""
        if stage not in STAGES:
            raise KeyError(f"no stage {stage!r}; the stages are {', '.join(STAGES)}")
        stream = self.streams.get(stage)
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def started(self) -> torch.cuda.Event | None:
        """A timing event queued on the calling thread's stream before a batch queues its
        work; None where the stage has no stream of its own (or it is capturing a graph)."""
        if not self._timed():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def handed_over(
        self,
        results: T,
        started: torch.cuda.Event | None = None,
        on_span: Callable[[float], None] | None = None,
    ) -> T:
        """`results` of a batch, once the calling thread's stream has run everything it
        queued (a no-op with one shared worker: one stream keeps its own order).

        With the event `started` gave, `on_span` gets the batch's seconds on the stream,
        from its first queued work to its last done, read once the wait is over (no sync
        of its own). Against the batch's wall time it tells a batch slowed on the GPU (the
        span grows: other work held the SMs) from one slowed on the host (it does not)."""
        if self.per_stage and self.device.type == "cuda":
            timed = started is not None and on_span is not None and self._timed()
            ended = torch.cuda.Event(enable_timing=True) if timed else None
            if ended is not None:
                ended.record()
            torch.cuda.current_stream(self.device).synchronize()
            if started is not None and ended is not None and on_span is not None:
                try:
                    span_ms = started.elapsed_time(ended)
                except RuntimeError:  # a measure must never fail the batch: stop measuring
                    log.exception("a batch's GPU span could not be read; no longer measured")
                    self._spans_broken = True
                else:
                    on_span(span_ms / 1000.0)
        return results

    def _timed(self) -> bool:
        return (
            not self._spans_broken
            and self.per_stage
            and self.device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing()
        )

    def synchronize(self) -> None:
        """Wait for every stream (the end of start-up: warm tensors made on one thread's
        stream are then safe to read from any other)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_cached(self) -> int:
        """Wait for every stream, then give the caching allocator's unused segments back to
        the device; the bytes given back (0 without CUDA). After each warmed bucket and
        at the end of start-up: what warm-up reserved for one shape, or on one stream, the
        next shape or another stream could seldom reuse."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)

    def peak_reserved(self) -> int:
        """The most the caching allocator has held at once (0 without CUDA): start-up's
        peak, which decides how many engines can warm up on one GPU together."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.max_memory_reserved(self.device)

    def shutdown(self) -> None:
        for executor in set(self._executors.values()):
            executor.shutdown(wait=True, cancel_futures=True)
