"""AOT packages on the CPU (g++): export, save, load, the same outputs as eager; a stale
package is named with what changed; a corrupt one is rebuilt, saying why.

Each build runs the C++ compiler (tens of seconds on a busy 2-core machine): the module
builds two packages, one per path that must build. A package has a dynamic batch
dimension: one per stage serves every bucket.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.aot import AotBuckets, AotStore, PackageKey, code_version, device_name, weights_hash
from models.swin import SWIN_CONFIGS, load_swin

CONFIG = SWIN_CONFIGS["swin_test"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_swin(CONFIG, None, seed=3).eval()


@pytest.fixture(scope="module")
def key(model: torch.nn.Module) -> PackageKey:
    device = torch.device("cpu")
    return PackageKey("swin_test", weights_hash(model), "fp32", device_name(device))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aot")


@pytest.fixture(scope="module")
def example() -> torch.Tensor:
    return torch.randn(
        2, 3, CONFIG.img_size, CONFIG.img_size, generator=torch.Generator().manual_seed(0)
    )


@pytest.fixture(scope="module")
def built(model, key, folder, example) -> AotBuckets:
    buckets = AotBuckets(model, AotStore(folder, key), "swin")
    assert buckets.prepare(example).startswith("built")
    return buckets


def test_a_package_round_trip_gives_the_eager_outputs(model, key, folder, example, built):
    with torch.inference_mode():
        eager = model(example)
        assert torch.allclose(built(example), eager, atol=1e-4, rtol=1e-4)
        # a new process's view: the same key finds the package on disk and loads it
        again = AotBuckets(model, AotStore(folder, key), "swin")
        assert again.prepare(example).startswith("loaded")
        assert torch.allclose(again(example), eager, atol=1e-4, rtol=1e-4)
        # a shape never prepared runs eagerly rather than failing
        one = example[:1]
        assert torch.equal(again(one), model(one))
        # one package serves every batch size: a second bucket shares it, nothing is built
        assert again.prepare(one).startswith("shared package")
        assert torch.allclose(again(one), model(one), atol=1e-4, rtol=1e-4)
        four = torch.cat([example, example.flip(0)])
        assert again.prepare(four).startswith("shared package")
        assert torch.allclose(again(four), model(four), atol=1e-4, rtol=1e-4)
        assert len(list(folder.rglob("*.pt2"))) == 1


def test_the_weights_and_the_code_are_in_the_key(model, key):
    assert len(key.code) == 0 and len(AotStore(Path("/x"), key).key.code) == 16
    assert code_version() == AotStore(Path("/x"), key).key.code
    other = load_swin(CONFIG, None, seed=4)
    assert weights_hash(other) != weights_hash(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_hash_sees_one_changed_byte(dtype):
    """The hash folds each tensor's bytes into sums where they live: equal weights hash
    equal, and the smallest change to one value anywhere (the last element of the last
    tensor included) changes it, as does a weight moved to another tensor."""
    model = load_swin(CONFIG, None, seed=0).to(dtype)
    same = load_swin(CONFIG, None, seed=0).to(dtype)
    assert weights_hash(same) == weights_hash(model)
    name, last = list(model.state_dict().items())[-1]
    for tensor in (next(model.parameters()), last):
        with torch.no_grad():
            flat = tensor.view(-1)
            before = flat[-1].clone()
            flat[-1] = torch.nextafter(before, torch.tensor(float("inf"), dtype=dtype))
            assert weights_hash(model) != weights_hash(same), name
            flat[-1] = before
    assert weights_hash(model) == weights_hash(same)
    with torch.no_grad():  # two values swapped: the same bytes at other positions
        w = next(model.parameters()).view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()
    assert weights_hash(model) != weights_hash(same)


def test_a_stale_package_says_what_changed(key, folder, example, built):
    store = AotStore(folder, key)
    package = store.path("swin", tuple(example.shape))
    assert store.why_rebuild(package) is None
    newer = AotStore(folder, replace(key, torch="9.9.9", weights="0" * 16))
    why = newer.why_rebuild(package)
    assert why is not None and why.startswith("stale")
    assert f"torch: {torch.__version__} -> 9.9.9" in why and "weights:" in why


def test_a_corrupt_package_is_rebuilt_saying_why(model, key, folder, example, built, caplog):
    store = AotStore(folder, key)
    package = store.path("swin", tuple(example.shape))
    package.write_bytes(package.read_bytes()[:4096])  # a copy cut short
    buckets = AotBuckets(model, store, "swin")
    with caplog.at_level(logging.INFO, logger="models.aot"):
        how = buckets.prepare(example)
    assert how.startswith("built") and "corrupt" in how, how
    assert any("building (corrupt" in r.getMessage() for r in caplog.records)
    with torch.inference_mode():
        assert torch.allclose(buckets(example), model(example), atol=1e-4, rtol=1e-4)
    assert AotStore(folder, key).why_rebuild(package) is None
