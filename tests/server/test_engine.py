"""After a compiled warm-up, the engine's batches run under `eager_on_recompile`, and
nothing else in the process does: a second engine's warm-up or a test keeps compiling.

The `eager` backend stands in for inductor (the guards, hence recompilations, are the
same; tests/server/test_stages_compile.py). A probe compiled for one shape tells the
stance by behaviour: a new shape recompiles under the default stance, runs eagerly under
the serving one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from server.domain import Image, Prompt, SegmentRequest
from server.engine import stages as stages_module
from server.engine.services import Engine
from server.engine.stages import DecodeItem, SamStages
from tests.server.conftest import small_settings


def eager_compile(fn: Callable[..., torch.Tensor], mode: str, *, dynamic: bool) -> object:
    return fn if mode == "none" else torch.compile(fn, dynamic=dynamic, backend="eager")


def test_the_serving_stance_is_held_around_served_batches_only(
    monkeypatch: pytest.MonkeyPatch, recompile_probe: Callable[[], bool]
) -> None:
    recompiles = recompile_probe

    seen_in_decode: list[bool] = []
    decode = SamStages.decode

    def decode_and_probe(self: SamStages, items: list[DecodeItem]) -> object:
        if engine.warmup_seconds is not None:  # served (warm-up's calls compile, as they must)
            seen_in_decode.append(recompiles())
        return decode(self, items)

    monkeypatch.setattr(stages_module, "compile_fn", eager_compile)
    monkeypatch.setattr(SamStages, "decode", decode_and_probe)
    settings = small_settings(
        compile_mode="default",
        enable_swin=False,
        max_batch_size=1,
        batch_buckets=[1],
        decoder_max_batch_prompts=1,
    )  # one bucket each: the shortest warm-up
    engine = Engine(settings)
    pixels = torch.randint(0, 256, (120, 160, 3), dtype=torch.uint8)
    request = SegmentRequest(
        (Prompt(box=(10.0, 10.0, 90.0, 70.0)),), image=Image("a" * 64, pixels, 160, 120)
    )

    async def serve_one() -> None:
        await engine.load()
        engine.start()
        await engine.warmup()
        assert recompiles()  # a compiled warm-up left the process's stance alone
        result = await engine.segment(request)
        assert len(result.results) == 1
        await engine.close()

    asyncio.run(serve_one())
    assert seen_in_decode == [False]  # the served batch ran a new shape eagerly
    assert recompiles()  # and the stance went back afterwards
