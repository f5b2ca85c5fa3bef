"""torch.compile(fullgraph=True) captures encode and decode whole: no graph breaks, hence no
host syncs (`.item()`, boolean-mask indexing) and no data-dependent branches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from models.sam import PromptSet, Sam, pack_prompts
from models.sam.prompts import PromptBatch


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs() -> tuple[Tensor, PromptBatch, Tensor]:
    g = torch.Generator().manual_seed(2)
    sets = [
        PromptSet([[10.0, 20.0]], [1]),
        PromptSet([[5.0, 6.0], [70.0, 80.0], [30.0, 9.0]], [1, 0, 1], [1.0, 2.0, 90.0, 99.0]),
        PromptSet(box=[3.0, 4.0, 50.0, 60.0], mask_input=torch.randn(1, 64, 64, generator=g)),
    ]
    images = torch.randn(2, 3, 256, 256, generator=g)
    return torch.randn(2, 256, 16, 16, generator=g), pack_prompts(sets, [0, 1, 1], "cpu"), images


# "eager" checks graph capture alone (about a second); "inductor" also generates and runs
# the C++ kernels, which takes about 50 s on 2 CPU cores.
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(tiny_sam: Sam, backend: str, fresh_dynamo: None) -> None:
    embeddings, prompts, images = _inputs()
    decode = torch.compile(tiny_sam.decode, fullgraph=True, backend=backend)
    encode = torch.compile(tiny_sam.encode, fullgraph=True, backend=backend)
    with torch.inference_mode():
        low_res, iou = decode(embeddings, prompts)
        eager_low_res, eager_iou = tiny_sam.decode(embeddings, prompts)
        torch.testing.assert_close(low_res, eager_low_res, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(iou, eager_iou, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(encode(images), tiny_sam.encode(images), rtol=1e-4, atol=1e-4)
