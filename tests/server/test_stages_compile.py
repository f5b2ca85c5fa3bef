"""Served decoder batches reuse the graphs warm-up compiled: no recompilation under load.

On an H100 the compiled decoder recompiled for every new mix of (images, prompts) in a
batch, holding the GIL on the GPU worker thread for seconds (docs/BENCHMARKS.md). Whether a
call recompiles is decided by dynamo's guards, whatever the backend, so the `eager` backend
checks it here in seconds: after warm-up, `fail_on_recompile` turns any recompilation into
an error while batches shaped as the service forms them run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from models.optimize import OptimizeOptions
from models.sam import SAM_CONFIGS, load_sam
from server.domain import Prompt
from server.engine.stages import WARM_MASK_SIDE, DecodeItem, EncodeItem, SamStages


def warmed_stages(decoder_buckets: list[int], graphs: list[object]) -> SamStages:
    """Stages warmed as the service warms them on CUDA, compiled with the cheapest backend
    (the guards, hence the graphs, are the same); `graphs` collects the traced graphs."""
    config = SAM_CONFIGS["vit_tiny"]
    model = load_sam(config, None, seed=0)
    stages = SamStages(
        model, config, torch.device("cpu"), OptimizeOptions(), [1, 2], decoder_buckets
    )
    stages.compiled = True

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    stages._decode = torch.compile(model.decode, dynamic=True, backend=counting)
    stages.warmup()
    return stages


@pytest.fixture
def stages() -> Iterator[SamStages]:
    torch._dynamo.reset()
    yield warmed_stages([1, 2, 4, 8], [])
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def test_warmup_traces_three_decoder_graphs() -> None:
    """One prompt set of one token form, one set of any form, any number of sets: each
    graph costs seconds of every start. With duck shaping a fourth graph held only while
    the set count equals the token count (traced at 2 sets of 2 tokens)."""
    torch._dynamo.reset()
    graphs: list[object] = []
    try:
        warmed_stages([1, 2, 4, 8, 16, 64], graphs)
        assert len(graphs) == 3
    finally:
        torch._dynamo.reset()


def test_warm_up_makes_its_masks_small_and_serving_larger_images_compiles_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decoder's warm-up masks are made at WARM_MASK_SIDE (at 1024x1024, 256 noise
    prompt sets held GBs of runs an engine), since nothing compiled sees the image's size:
    after it, a large image's batch runs without a new graph."""
    sizes: list[tuple[int, int]] = []
    decode = SamStages.decode

    def recording(self: SamStages, items: list[DecodeItem]) -> object:
        sizes.extend(item.embedding.original_size for item in items)
        return decode(self, items)

    monkeypatch.setattr(SamStages, "decode", recording)
    torch._dynamo.reset()
    graphs: list[object] = []
    try:
        stages = warmed_stages([1, 2, 4], graphs)
        assert sizes and set(sizes) == {(WARM_MASK_SIDE, WARM_MASK_SIDE)}
        warmed = len(graphs)
        pixels = torch.randint(0, 256, (600, 900, 3), dtype=torch.uint8)
        (entry,) = stages.encode([EncodeItem("large", pixels)])
        with torch.compiler.set_stance("fail_on_recompile"):
            (masks,) = stages.decode([DecodeItem(entry, tuple(_prompts(900, 600)), True)])
        assert len(graphs) == warmed and masks[0].masks is not None
        assert masks[0].masks.shape[-2:] == (600, 900)
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()


def _prompts(w: int, h: int) -> list[Prompt]:
    return [
        Prompt(points=((w / 2, h / 2),), labels=(1,)),
        Prompt(box=(w / 5, h / 5, w / 2, h / 2)),
        Prompt(
            points=((w / 3, h / 3), (w / 4, h / 5), (w / 2, h / 3)),
            labels=(1, 0, 1),
            box=(1.0, 2.0, w / 2, h / 2),
        ),
        Prompt(points=tuple((w * k / 11, h * k / 11) for k in range(1, 11)), labels=(1,) * 10),
    ]


def test_service_shaped_batches_do_not_recompile(stages: SamStages) -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [(120, 160), (300, 200), (256, 256)]
    pixels = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in sizes]
    entries = stages.encode([EncodeItem(f"img-{k}", p) for k, p in enumerate(pixels)])
    mask = torch.randn(1, 64, 64, generator=g)
    batches = [
        # requests on three images in one batch, one prompt each (the one-box load test)
        [DecodeItem(e, (_prompts(*e.original_size[::-1])[1],), False) for e in entries],
        # mixed prompt kinds and counts, multimask or not, a refinement click among them
        [
            DecodeItem(entries[0], tuple(_prompts(160, 120)), True),
            DecodeItem(entries[1], (_prompts(200, 300)[3],), False, mask_input=mask),
            DecodeItem(entries[2], tuple(_prompts(256, 256)[:2]), True),
        ],
        # one request alone, and sizes between the buckets
        [DecodeItem(entries[2], (_prompts(256, 256)[0],), True)],
        [DecodeItem(entries[k % 3], (_prompts(50, 50)[k % 4],), False) for k in range(7)],
    ]
    torch.compiler.set_stance("fail_on_recompile")
    for items in batches:
        results = stages.decode(items)  # raises if dynamo needed a new graph
        assert [len(r) for r in results] == [len(i.prompts) for i in items]


def test_the_encoder_compiles_each_graph_once() -> None:
    """Warm-up's example was made outside inference mode, so uncaptured (no CUDA graphs)
    each bucket compiled once for it and again for the first served-like batch; the
    guards differ on inference tensors, which every served batch is."""
    from models.optimize import GraphedBuckets

    torch._dynamo.reset()
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    config = SAM_CONFIGS["vit_tiny"]
    model = load_sam(config, None, seed=0)
    stages = SamStages(model, config, torch.device("cpu"), OptimizeOptions(), [1, 2, 4], [1])
    stages._encode = GraphedBuckets(
        torch.compile(model.encode, dynamic=True, backend=counting), enabled=False
    )
    stages.encoder_compiled = True
    try:
        for bucket in stages.encoder_buckets:
            stages.warm_encoder(bucket)
        # one graph for a batch of one (dynamo specialises sizes of 1), one for all others;
        # four with the plain example
        assert len(graphs) == 2
        pixels = torch.randint(0, 256, (100, 140, 3), dtype=torch.uint8)
        torch.compiler.set_stance("fail_on_recompile")
        stages.encode([EncodeItem(f"img-{k}", pixels) for k in range(3)])
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
