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
from server.engine import sam2_stages as sam2_stages_module
from server.engine import stages as stages_module
from server.engine.services import Engine
from server.engine.stages import DecodeItem, SamStages
from tests.server.conftest import small_settings


def eager_compile(
    fn: Callable[..., torch.Tensor], mode: str, *, dynamic: bool, exact_casts: bool = False
) -> object:
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


def test_sam2_segment_everything_runs_the_decoder_warm_up_compiled(
    monkeypatch: pytest.MonkeyPatch, recompile_probe: Callable[[], bool]
) -> None:
    """SAM 2's segment everything gets the grid's decoder call compiled (one graph, the
    chunk size dynamic), warmed before ready with a start-up step of its own; a served
    request's chunks run that graph, under the serving stance (no new graph)."""
    graphs: list[object] = []
    calls: list[int] = []

    def counting_compile(fn: Callable[..., object], mode: str, *, dynamic: bool) -> object:
        if mode == "none":
            return fn

        def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True, backend=backend)
        if "point_decoder" not in fn.__qualname__:  # only segment everything's is counted
            return compiled

        def counted(*args: object) -> object:
            calls.append(int(args[3].shape[0]))  # type: ignore[attr-defined]
            return compiled(*args)

        return counted

    monkeypatch.setattr(sam2_stages_module, "compile_fn", counting_compile)
    settings = small_settings(
        sam_model="sam2_test_tiny", compile_mode="default", enable_swin=False,
        max_batch_size=1, batch_buckets=[1], decoder_max_batch_prompts=1, decoder_graphs=False,
    )  # fmt: skip
    engine = Engine(settings)
    labels = [label for label, _ in engine.warm_steps()]
    assert "compiling SAM 2's segment-everything decoder, 64 points" in labels
    pixels = torch.randint(0, 256, (96, 128, 3), dtype=torch.uint8)

    async def serve_one() -> None:
        await engine.load()
        engine.start()
        await engine.warmup()
        warmed = len(graphs)
        assert calls == [64]  # the warm-up's chunk
        # 10 x 10 points, chunks of 64 and 36: the dynamic graph takes both
        fields = {"points_per_side": 10, "pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}
        image = Image("b" * 64, pixels, 128, 96)
        _, masks, _ = await engine.everything(image, None, fields)
        assert len(masks.scores) >= 1
        assert calls == [64, 64, 36]
        assert len(graphs) == warmed  # nothing compiled while serving
        await engine.close()

    asyncio.run(serve_one())
    assert recompile_probe()  # the serving stance was held only around the steps
