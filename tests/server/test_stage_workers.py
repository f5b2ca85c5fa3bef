"""A thread (and, on CUDA, a stream) per stage: the stages run beside each other and every
answer is the one a single worker thread gives.

On the CPU there are no streams, but the threads, the executors each batcher gets, the
hand-over between the encoder's thread and the decoder's, and start-up on the encoder's
thread are the same code as on a GPU.
"""

from __future__ import annotations

import asyncio
import os
import threading
from contextlib import AbstractContextManager

import numpy as np
import pytest
import torch

from server.domain import Image, Prompt, SegmentRequest
from server.engine.services import Engine
from server.engine.workers import STAGES, StageWorkers
from server.threadnames import os_thread_name
from tests.server.conftest import small_settings

STAGES_LIST = list(STAGES)


def test_each_stage_has_its_own_thread_per_stage_and_one_shared_otherwise() -> None:
    cpu = torch.device("cpu")
    per_stage = StageWorkers(cpu, "per_stage")
    shared = StageWorkers(cpu, "auto")  # auto: one thread on the CPU
    try:
        names = {
            stage: per_stage[stage].submit(lambda: threading.current_thread().name).result()
            for stage in STAGES
        }
        assert len(set(names.values())) == len(STAGES)
        assert all(name.startswith(f"gpu-{stage}") for stage, name in names.items())
        # the OS knows them too (top -H, py-spy, the bench's CPU by thread): 15 bytes of it
        tids = {stage: per_stage[stage].submit(threading.get_native_id).result()
                for stage in STAGES}  # fmt: skip
        for stage, tid in tids.items():
            assert os_thread_name(os.getpid(), tid) == f"gpu-{stage}_0"[:15]
        assert os_thread_name(os.getpid(), 2**22 + 1) is None  # no such thread
        assert not shared.per_stage and len({id(shared[s]) for s in STAGES}) == 1
        assert per_stage.handed_over([1, 2]) == [1, 2]
        # no stream, no span: the batch's GPU span is a CUDA measure (serve_batch_gpu_seconds)
        spans: list[float] = []
        started = per_stage[STAGES_LIST[0]].submit(per_stage.started).result()
        assert started is None
        assert per_stage.handed_over([3], started, spans.append) == [3] and spans == []
        # warm-up captures each stage's graphs on its stream; on the CPU there is none, but
        # a name that is no stage fails here rather than leaving a GPU's graphs unranked
        for stage in STAGES:
            with per_stage.on_stream(stage):
                assert per_stage.streams == {}
        with pytest.raises(KeyError, match="sam2_encoder"):
            per_stage.on_stream("sam2_encoder")
    finally:
        per_stage.shutdown()
        shared.shutdown()


def _image(seed: int, size: tuple[int, int]) -> Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image(f"{seed:064x}", torch.from_numpy(pixels), size[1], size[0])


def click(k: int) -> Prompt:
    return Prompt(points=((20.0 + k, 30.0),), labels=(1,))


async def _serve(engine: Engine) -> tuple[list[object], list[object]]:
    """Many segment, click and classify calls at once, so the stages' batches overlap."""
    await engine.load()
    engine.start()
    await engine.warmup()
    images = [_image(n, (96 + 8 * n, 128)) for n in range(6)]
    boxes = [
        engine.segment(SegmentRequest((Prompt(box=(8.0, 8.0, 90.0, 80.0)),), image=img))
        for img in images
    ]
    classes = [engine.classify(img, 3) for img in images]
    segmented = await asyncio.gather(*boxes, *classes)
    clicks = [
        engine.segment(SegmentRequest((click(k),), multimask=True, image_id=img.image_id))
        for img in images
        for k in range(3)
    ]
    clicked = await asyncio.gather(*clicks, *[engine.classify(img, 2) for img in images])
    await engine.close()
    return list(segmented), list(clicked)


def test_per_stage_threads_answer_as_one_thread_does() -> None:
    answers = []
    for mode in ("one", "per_stage"):
        engine = Engine(small_settings(stage_threads=mode, max_queue_delay_ms=2.0))
        assert engine.workers.per_stage == (mode == "per_stage")
        answers.append(asyncio.run(_serve(engine)))
    (one_seg, one_click), (many_seg, many_click) = answers
    for a, b in zip(one_seg + one_click, many_seg + many_click, strict=True):
        assert type(a) is type(b)
        if hasattr(a, "predictions"):
            assert [p.index for p in a.predictions] == [p.index for p in b.predictions]
            continue
        for pa, pb in zip(a.results, b.results, strict=True):
            np.testing.assert_allclose(pa.scores, pb.scores, rtol=1e-4, atol=1e-4)
            # batches formed differently round differently: masks agree on nearly every pixel
            assert pa.masks is not None and pb.masks is not None  # host RLE on the CPU
            assert pa.masks.shape == pb.masks.shape
            assert (pa.masks == pb.masks).mean() > 0.99


def test_releasing_the_cache_gives_nothing_back_without_cuda() -> None:
    # on CUDA it waits for every stream and empties the caching allocator (after each warmed
    # bucket and at the end of start-up, measured on the GPU: docs/BENCHMARKS.md); the CPU
    # has no such cache, and no peak
    workers = StageWorkers(torch.device("cpu"), "per_stage")
    try:
        assert workers.release_cached() == 0
        assert workers.peak_reserved() == 0
    finally:
        workers.shutdown()


def test_warm_up_gives_each_bucket_s_transients_back_before_the_next() -> None:
    """Kept, the buckets' transients added up to 12.6 GB an engine and six engines would
    not have started on an 80 GB H100: every warmed bucket is followed by a release, on
    the thread that warmed it, and warm-up counts what came back."""
    engine = Engine(small_settings())  # eager: one bucket a stage (compiled: every bucket)
    released: list[str] = []

    def release() -> int:
        released.append(threading.current_thread().name)
        return 1 << 20

    engine.workers.release_cached = release  # type: ignore[method-assign]
    # each bucket warms with its stage's stream current, so that on a GPU the graphs it
    # captures keep the stage's priority (a graph runs at its capture stream's: measured)
    streams: list[str] = []
    on_stream = engine.workers.on_stream

    def entered(stage: str) -> AbstractContextManager[object]:
        streams.append(stage)
        return on_stream(stage)

    engine.workers.on_stream = entered  # type: ignore[method-assign]

    async def warm() -> tuple[int, str]:
        await engine.load()
        engine.start()
        steps = len(engine.warm_steps())
        await engine.warmup()
        warm_thread = engine.worker.submit(lambda: threading.current_thread().name).result()
        await engine.close()
        return steps, warm_thread

    steps, warm_thread = asyncio.run(warm())
    assert steps == 3  # the encoder's, the decoder's and Swin's
    assert len(released) == steps and engine.warm_released_bytes == steps << 20
    assert set(released) == {warm_thread}
    assert streams == ["sam_encoder", "sam_decoder", "swin"]


def test_confining_the_encoders_to_sms_is_refused_where_no_green_context_can_run() -> None:
    # On CUDA the encoder stages' streams come from a green context of SERVE_ENCODER_SMS SMs
    # (measured on the GPU: docs/BENCHMARKS.md issue 19). On the CPU, or with one stream for
    # every stage, there is nothing to confine: start-up names the setting, never a silent
    # no-op that a load test would read as "confining gained nothing".
    for mode in ("per_stage", "one"):
        with pytest.raises(ValueError, match=r"SERVE_ENCODER_SMS=96.*CUDA device"):
            StageWorkers(torch.device("cpu"), mode, encoder_sms=96)
    with pytest.raises(ValueError, match="SERVE_ENCODER_SMS=64"):
        Engine(small_settings(encoder_sms=64))
    workers = StageWorkers(torch.device("cpu"), "per_stage", encoder_sms=0)  # 0: all SMs
    try:
        assert workers.encoder_sms == 0
    finally:
        workers.shutdown()
