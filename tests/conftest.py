"""Test-wide set-up: Meta's `segment_anything` imports torchvision, which has no CPU build
matching our torch; where no real torchvision imports, the test-only stand-in in
tests/_stubs goes on `sys.path` first (see tests/_stubs/README.md)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.schedule import slowest_first

STUBS = Path(__file__).resolve().parent / "_stubs"
# small real photos committed with the tests (their attribution: tests/photos/NOTICE)
PHOTOS = Path(__file__).resolve().parent / "photos"


def pytest_configure(config: pytest.Config) -> None:
    try:
        importlib.import_module("torchvision")
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, str(STUBS))
    share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order xdist hands the modules out in
        slowest_first(items)


def share_the_cores() -> None:
    """An xdist worker (`-n N`) takes its share of the cores for torch's threads, and its
    subprocesses (servers, Triton-interpreter scripts, compiles) inherit that share
    through OMP_NUM_THREADS.

    Left at torch's default, each worker ran as many OpenMP threads as the machine has
    cores, and OpenMP's threads spin while they wait for each other: with both of CI's two
    workers in torch, four spinning threads on two cores. The two synthetic-weights
    trainings side by side (tests/models/test_synthesize.py, test_sam2_synthesize.py, one
    a worker) took over 430 s each that way, 50 s each with one thread a worker. An
    OMP_NUM_THREADS set by hand is kept; a run without xdist keeps torch's default."""
    from server.settings import available_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    share = max(1, available_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


@pytest.fixture
def recompile_probe() -> Iterator[Callable[[], bool]]:
    """Call it: whether a never-seen shape made dynamo compile again, which tells the
    process's compile stance by behaviour (default: recompiles; `eager_on_recompile`:
    runs eagerly). Dynamo and the stance are reset around the test."""
    torch._dynamo.reset()
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    add_one = torch.compile(lambda x: x + 1, backend=counting, dynamic=False)
    add_one(torch.zeros(1))
    sizes = iter(range(2, 1000))

    def recompiles() -> bool:
        before = len(graphs)
        add_one(torch.zeros(next(sizes)))
        return len(graphs) > before

    yield recompiles
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def small_photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three committed photos at most 200 px a side (two JPEGs, one PNG): real content
    that the tiny models run in about a second on the CPU."""
    sources = sorted(PHOTOS.glob("*.jpg"))
    assert len(sources) == 3, f"{PHOTOS} must hold the three test photos"
    folder = tmp_path_factory.mktemp("small-photos")
    for k, path in enumerate(sources):
        with Image.open(path) as image:
            small = image.convert("RGB")
            small.thumbnail((200, 200))
            small.save(folder / (f"{path.stem}.png" if k == 2 else path.name))
    return folder


def photo_like_array(height: int, width: int, seed: int) -> np.ndarray:
    """A seeded picture with what photos have: smooth colour fields, blobs with edges,
    fine texture and noise (uint8 `[H, W, 3]`), so tests need no photo files."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) / max(height, width)
    rgb = np.zeros((height, width, 3), np.float32)
    for c in range(3):  # low-frequency colour fields
        fx, fy, phase = (*rng.uniform(0.5, 3, 2).tolist(), rng.uniform(0, 6.3))
        rgb[..., c] = 128 + 70 * np.sin(2 * np.pi * (fx * xx + fy * yy) + phase)
    for _ in range(int(rng.integers(4, 9))):  # objects: ellipses and rectangles
        cx, cy = (
            rng.uniform(0, width / max(height, width)),
            rng.uniform(0, height / max(height, width)),
        )
        rx, ry = rng.uniform(0.04, 0.25, 2)
        colour = rng.uniform(0, 255, 3)
        if rng.random() < 0.5:
            inside = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 < 1
        else:
            inside = (np.abs(xx - cx) < rx) & (np.abs(yy - cy) < ry)
        rgb[inside] = 0.3 * rgb[inside] + 0.7 * colour
    rgb += 12 * np.sin(40 * np.pi * xx * rng.uniform(0.5, 2))[..., None]  # texture
    rgb += rng.normal(0, 6, rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


@pytest.fixture(scope="session")
def generated_photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four seeded photo-like pictures (three JPEGs, one PNG) of different shapes."""
    folder = tmp_path_factory.mktemp("generated-photos")
    for k, (h, w) in enumerate([(240, 320), (256, 256), (300, 200), (260, 400)]):
        image = Image.fromarray(photo_like_array(h, w, seed=k))
        image.save(folder / (f"photo{k}.png" if k == 3 else f"photo{k}.jpg"), quality=92)
    return folder


# vit_tiny synthetic weights as the tests make them (tests/models/test_synthesize.py has
# what they measured). Training takes about 21 s on 2 free cores (250 steps of 8 prompts,
# 85 ms each; 300 steps took 110-225 s on 2 cores shared by 4 jobs); the tests that use them
# allow SYNTHETIC_TIMEOUT_S. No refinement prompts (`mask_input`): in so few steps they
# cost the plain prompts the tests measure (200 steps: held-out point IoU 0.68 with a
# quarter of them, 0.70 without; 250 without: 0.75, min 0.69).
SYNTHETIC_TEST_STEPS = 250
SYNTHETIC_TEST_BATCH = 8
SYNTHETIC_TIMEOUT_S = 900


def run_tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary folder, the one its xdist workers share (each has its own
    below it); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def run_lock(folder: Path) -> Iterator[None]:
    """Held by one process of the run at a time (an flock on `folder/.lock`, given back by
    the kernel if its holder dies)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def synthetic_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, generated_photo_dir: Path
) -> tuple[Path, Any]:
    """vit_tiny synthetic weights trained once per run on the generated photos, saved with
    their sidecar: (path, `SynthesisReport`).

    Once per run, not per xdist worker: test_synthesize.py, test_synthetic_weights.py and
    test_page.py use them, and land on both workers; each worker trained its own (a minute
    each on CI's cores). The first worker to ask trains them under `run_lock`, in a folder
    of the run's shared temporary folder named by the options and the photos; the others
    wait for it, then read the file and the report that `synthesize` returned (written
    beside it by this fixture, not by `save_synthetic`, whose sidecar the tests check)."""
    from models.fidelity import load_photos
    from models.sam import SAM_CONFIGS
    from models.sam.synthesize import (
        SynthesisOptions,
        SynthesisReport,
        save_synthetic,
        synthesize,
    )

    options = SynthesisOptions(
        steps=SYNTHETIC_TEST_STEPS,
        batch_size=SYNTHETIC_TEST_BATCH,
        crops=32,
        heldout_crops=8,
        heldout_prompts=16,
        mask_input_fraction=0.0,
    )
    key = hashlib.sha256(repr(options).encode())
    for photo in sorted(generated_photo_dir.iterdir()):
        key.update(photo.name.encode() + photo.read_bytes())
    folder = run_tmp_path(tmp_path_factory) / f"synthetic-vit_tiny-{key.hexdigest()[:16]}"
    path, saved_report = folder / "sam_vit_tiny_synthetic.pth", folder / "report.json"
    with run_lock(folder):
        if not saved_report.is_file():
            photos = load_photos(generated_photo_dir)
            model, report = synthesize(
                SAM_CONFIGS["vit_tiny"], photos, options, torch.device("cpu")
            )
            save_synthetic(model, report, path)
            saved_report.write_text(json.dumps(report.as_dict()))
            return path, report
    return path, SynthesisReport(**json.loads(saved_report.read_text()))
