"""`server.engine.first_turn`: one engine of a host warms a quantised bucket first, the
others wait for it, then warm from its caches at once. The lock is a real file lock between
real processes; the engine test runs a real warm-up under it on the CPU."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from server.engine.first_turn import first_turn, first_turn_folder, first_turn_key

KEY = "swin swin_tiny int8 batch 8 default on NVIDIA H200, torch 2.11, triton 3.6"


def _take_turn(
    folder: str, key: str, hold_s: float, ready: multiprocessing.Queue, out: multiprocessing.Queue
) -> None:
    """In a child process: wait for the turn, report whether it was first and when the
    body ran."""
    ready.put(True)
    with first_turn(Path(folder), key) as first:
        began = time.monotonic()
        time.sleep(hold_s)
        out.put((first, began, time.monotonic()))


def test_the_first_process_warms_alone_and_the_others_follow_at_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready: multiprocessing.Queue = context.Queue()
    out: multiprocessing.Queue = context.Queue()
    # the first takes the lock now; the others start while it holds it
    with first_turn(tmp_path, KEY) as first:
        assert first
        children = [
            context.Process(target=_take_turn, args=(str(tmp_path), KEY, 1.0, ready, out))
            for _ in range(3)
        ]
        for child in children:
            child.start()
        for _ in children:  # each at the lock (their imports take a while on a busy CI)
            ready.get(timeout=120)
        time.sleep(0.5)
        assert out.empty()  # they are waiting, not running
        released = time.monotonic()
    turns = [out.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert [first for first, _, _ in turns] == [False] * 3  # the mark was there for each
    assert all(began >= released for _, began, _ in turns)
    # after the first, they ran side by side: each body started before another ended
    starts = sorted(began for _, began, _ in turns)
    assert starts[-1] < min(ended for _, _, ended in turns)


def test_a_warm_up_that_fails_leaves_no_mark(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), first_turn(tmp_path, KEY) as first:
        assert first
        raise RuntimeError("out of memory")
    with first_turn(tmp_path, KEY) as first:  # the next engine warms it first instead
        assert first
    with first_turn(tmp_path, KEY) as first:
        assert not first
    with first_turn(tmp_path, KEY.replace("batch 8", "batch 16")) as first:
        assert first  # each bucket its own turn


def test_only_quantised_stages_on_a_gpu_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert first_turn_key("swin", 8, cpu, "int8", "swin_tiny", "default") is None
    assert first_turn_key("swin", 8, gpu, "none", "swin_tiny", "default") is None
    # no GPU here: the name a GPU machine reports
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    key = first_turn_key("swin", 8, gpu, "int8", "swin_tiny", "default")
    assert key is not None and "NVIDIA H200" in key and "batch 8" in key
    assert key != first_turn_key("swin", 8, gpu, "fp8", "swin_tiny", "default")


def test_the_folder_sits_beside_the_shared_caches(tmp_path: Path) -> None:
    assert first_turn_folder(tmp_path) == tmp_path / "first-turn"
    assert first_turn_folder(None).name.startswith("serve-first-turn-")


def test_an_engine_warms_a_quantised_stage_through_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real (CPU) int8 engine's warm-up, its stages keyed as on a GPU: SAM's encoder and
    Swin take turns, the decoder does not; marks are left for each bucket warmed."""
    # imported here: the other tests' child processes import this module, and need less
    from server.engine.services import Engine
    from tests.server.conftest import small_settings

    settings = small_settings(
        quantization="int8",
        swin_quantization="none",
        compile_cache_dir=tmp_path,
        batch_buckets=[1],
        max_batch_size=1,
        classify_max_batch_size=1,
    )
    engine = Engine(settings)
    keyed: list[tuple[str, int]] = []

    def as_on_a_gpu(stage: str, bucket: int) -> str | None:
        keyed.append((stage, bucket))
        options = engine.swin_options if stage == "swin" else engine.options
        if stage not in ("sam_encoder", "swin") or options.quantization == "none":
            return None
        return f"{stage} batch {bucket} {options.quantization}"

    monkeypatch.setattr(engine, "_first_turn_key", as_on_a_gpu)

    async def warm() -> None:
        await engine.load()
        engine.start()
        await engine.warmup()
        await engine.close()

    asyncio.run(warm())
    marks = sorted(p.read_text().strip() for p in (tmp_path / "first-turn").glob("*.done"))
    assert marks == ["sam_encoder batch 1 int8"]  # Swin unquantised: no turn
    assert ("swin", 1) in keyed and any(stage == "sam_decoder" for stage, _ in keyed)
    # the real keys on this CPU engine: none (nothing is tuned by timing here)
    assert Engine._first_turn_key(engine, "sam_encoder", 1) is None
