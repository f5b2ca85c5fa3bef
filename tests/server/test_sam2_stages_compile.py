"""SAM 2's stages as CUDA compiles them: whole graphs, and none new under load.

On a GPU `Sam2Stages` compiles its encoder and decoder functions with dynamic shapes
(`compile_fn`, `fullgraph=True`). Whether dynamo can trace them whole, and whether a
service-shaped batch after warm-up needs a new graph, is decided before any backend runs,
so the cheapest backend checks both here in seconds (as tests/server/test_stages_compile.py
does for SAM): a graph break fails the trace, `fail_on_recompile` fails a recompilation, and
the traced graphs must give the eager stages' masks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from models.optimize import GraphedBuckets, OptimizeOptions
from models.sam2 import SAM2_CONFIGS, load_sam2
from server.domain import Prompt
from server.engine.sam2_stages import Sam2Stages
from server.engine.stages import DecodeItem, EncodeItem

BUCKETS = [1, 2, 4, 8]


def _stages() -> Sam2Stages:
    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None, seed=0)
    return Sam2Stages(model, torch.device("cpu"), OptimizeOptions(), [1, 2], BUCKETS)


def traced_stages(graphs: dict[str, list[object]], decoder_graphs: bool = False) -> Sam2Stages:
    """Stages warmed as on CUDA (every bucket, every decoder form, a mask input always),
    their two functions traced whole by dynamo; `graphs` collects what each traced. With
    `decoder_graphs`, the decoder's graph buffers too (filled and decoded as a capture
    would, `DecoderGraphs(graphs=False)`)."""
    stages = _stages()

    def compiled(fn: Callable[..., object], name: str) -> Callable[..., object]:
        def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
            graphs.setdefault(name, []).append(gm)
            return gm.forward

        return torch.compile(fn, dynamic=True, fullgraph=True, backend=counting)

    encode = compiled(stages._encode_tensors, "encoder")
    stages._encode = GraphedBuckets(encode, enabled=False)  # type: ignore[arg-type]
    stages._decode_sets = compiled(stages._decode_tensors, "decoder")  # type: ignore[assignment]
    stages.encoder_compiled = stages.compiled = True
    if decoder_graphs:
        stages._graphs = stages.decoder_graphs(graphs=False)
    stages.warmup()
    return stages


@pytest.fixture
def dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def _prompts(w: int, h: int) -> list[Prompt]:
    return [
        Prompt(points=((w / 2, h / 2),), labels=(1,)),
        Prompt(box=(w / 5, h / 5, w / 2, h / 2)),
        Prompt(points=((w / 3, h / 3), (w / 4, h / 5)), labels=(1, 0), box=(1.0, 2.0, w / 2, h)),
        Prompt(points=tuple((w * k / 11, h * k / 11) for k in range(1, 11)), labels=(1,) * 10),
    ]


def test_traced_whole_no_recompile_under_load_and_eager_masks(dynamo: None) -> None:
    graphs: dict[str, list[object]] = {}
    stages = traced_stages(graphs)
    # one set, and any number of sets (a batch of 1 is specialised); the encoder's count
    # is `_prepare`'s: without CUDA graphs its example is no inference tensor, so each
    # bucket is traced twice (with graphs, the second call replays the graph instead)
    assert len(graphs["decoder"]) == 2, graphs
    assert len(graphs["encoder"]) <= 4, graphs
    eager = _stages()
    g = torch.Generator().manual_seed(0)
    sizes = [(120, 160), (300, 200)]
    pixels = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in sizes]
    torch.compiler.set_stance("fail_on_recompile")
    entries = stages.encode([EncodeItem(f"img-{k}", p) for k, p in enumerate(pixels)])
    mask = torch.randn(1, 64, 64, generator=g)
    batches = [
        [DecodeItem(e, (_prompts(*e.original_size[::-1])[1],), False) for e in entries],
        [
            DecodeItem(entries[0], tuple(_prompts(160, 120)), True),
            DecodeItem(entries[1], (_prompts(200, 300)[3],), False, mask_input=mask),
            DecodeItem(entries[1], tuple(_prompts(200, 300)[:2]), True),
        ],
        [DecodeItem(entries[k % 2], (_prompts(50, 50)[k % 4],), False) for k in range(7)],
    ]
    served = [stages.decode(items) for items in batches]  # raises if dynamo needed a graph
    torch.compiler.set_stance("default")
    for items, results in zip(batches, served, strict=True):
        alone = eager.decode(items)
        for got, want in zip(results, alone, strict=True):
            for g_masks, w_masks in zip(got, want, strict=True):
                assert g_masks.masks is not None and w_masks.masks is not None
                assert (g_masks.masks != w_masks.masks).mean() <= 1e-5
                np.testing.assert_allclose(g_masks.scores, w_masks.scores, atol=1e-5)
