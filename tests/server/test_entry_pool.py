"""What outlives a batch is allocated inside the entry pool (`EntryPool`): the cached
embeddings the encoders return (SAM 2's high-res maps too) and entries brought back from the
cache's host tier. On CUDA the pool keeps them out of the segments the stages' transient
tensors reuse (docs/BENCHMARKS.md, issue 19: 52-81 GB reserved for 4-8 GB allocated
without it); here a pool that records which tensors were made inside it checks the
routing, which is the part the CPU can run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.optimize import OptimizeOptions
from models.sam import SAM_CONFIGS, load_sam
from models.sam2 import SAM2_CONFIGS, load_sam2
from server.engine.cache import EmbeddingCache, ImageEmbedding
from server.engine.gpu_memory import EntryPool
from server.engine.sam2_stages import Sam2Stages
from server.engine.stages import EncodeItem, SamStages

CPU = torch.device("cpu")


class _Made(TorchDispatchMode):
    """Collects the storages of every tensor an op returns while active."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                self.storages.add(value.untyped_storage().data_ptr())
        return out


class RecordingPool(EntryPool):
    """An `EntryPool` on the CPU that remembers the storages made inside `allocating`."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.storages: set[int] = set()
        self.entered = 0

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        self.entered += 1
        with _Made(self.storages):
            yield


def made_in(pool: RecordingPool, entry: ImageEmbedding) -> bool:
    return all(t.untyped_storage().data_ptr() in pool.storages for t in entry.tensors)


def photos(sizes: list[tuple[int, int]]) -> list[EncodeItem]:
    rng = np.random.default_rng(0)
    return [
        EncodeItem(f"img-{k}", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for k, (h, w) in enumerate(sizes)
    ]


def test_sam_embeddings_are_allocated_in_the_pool_one_storage_each() -> None:
    config = SAM_CONFIGS["vit_tiny"]
    pool = RecordingPool()
    stages = SamStages(
        load_sam(config, None, seed=0), config, CPU, OptimizeOptions(), [1, 2], [1],
        entry_pool=pool,
    )  # fmt: skip
    entries = stages.encode(photos([(120, 160), (90, 200)]))
    assert pool.entered == 1 and len(entries) == 2
    assert all(made_in(pool, e) for e in entries)
    # each its own storage: evicting one frees it (a view of the batch would not)
    storages = {e.embedding.untyped_storage().data_ptr() for e in entries}
    assert len(storages) == 2
    assert all(e.embedding.untyped_storage().nbytes() == e.nbytes for e in entries)


def test_sam2_embeddings_and_high_res_maps_are_allocated_in_the_pool() -> None:
    model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None, seed=0)
    pool = RecordingPool()
    stages = Sam2Stages(model, CPU, OptimizeOptions(), [1, 2], [1], entry_pool=pool)
    entries = stages.encode(photos([(100, 150), (140, 90)]))
    assert all(len(e.high_res) == 2 and made_in(pool, e) for e in entries)
    assert sum(t.untyped_storage().nbytes() for e in entries for t in e.tensors) == sum(
        e.nbytes for e in entries
    )


def test_entries_back_from_the_host_tier_are_allocated_in_the_pool() -> None:
    pool = RecordingPool()
    cache = EmbeddingCache(400, host_bytes=800, pool=pool)
    for name in ("a", "b"):
        cache.put(ImageEmbedding(name, torch.full((100,), float(len(name))), (8, 8), (8, 8)))
    assert cache.peek("a") is not None and "a" in cache.host_tier.entries
    assert cache.get("b") is not None and pool.entered == 0  # a device hit moves nothing
    back = cache.get("a")
    # the move to the device ran inside the pool (on the CPU it copies nothing: the host
    # tier is the device's memory there, so only the routing is seen)
    assert back is not None and pool.entered == 1
    assert torch.equal(back.embedding, torch.full((100,), 1.0))


def test_the_pool_changes_nothing_on_the_cpu() -> None:
    pool = EntryPool(CPU)
    with pool.allocating():
        made = torch.ones(3)
    assert made.device == CPU and pool.reserved_bytes() == 0
