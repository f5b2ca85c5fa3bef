"""How frontends pick an engine, and how the supervisor gives engines their GPUs.

Pure functions, no server (a supervisor object at most, never run): the rendezvous hash
(stable, balanced, minimal movement), the least-loaded choice for calls without an image,
the service's status combined from each engine's, and the GPU plan from
CUDA_VISIBLE_DEVICES or `nvidia-smi -L` text. The real processes are in
tests/server/test_engines.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from server.gpus import (
    ENGINE_MEMORY_MIB,
    gpu_memory_mib,
    parse_nvidia_smi,
    parse_visible,
    plan_engines,
)
from server.http.engine_client import EngineClient, combined_status, rendezvous_hash
from server.messages import Status
from server.settings import Settings

IDS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(10_000)]


def test_an_image_s_home_is_fixed_for_every_process_and_release():
    """Pinned: a frontend of another process, or of the next release, must agree, or
    clicks after a rolling restart would miss every embedding."""
    homes = [rendezvous_hash(image_id, range(4)) for image_id in IDS[:12]]
    assert homes == [1, 2, 0, 3, 1, 1, 1, 0, 2, 2, 3, 2]
    assert [rendezvous_hash(image_id, range(2)) for image_id in IDS[:12]] == [
        1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1,
    ]  # fmt: skip
    assert rendezvous_hash(IDS[0], range(1)) == 0
    with pytest.raises(ValueError):
        rendezvous_hash(IDS[0], [])


@pytest.mark.parametrize("engines", [2, 4])
def test_the_hash_spreads_images_evenly(engines):
    counts = Counter(rendezvous_hash(image_id, range(engines)) for image_id in IDS)
    fair = len(IDS) / engines
    assert sorted(counts) == list(range(engines))
    for engine, count in counts.items():
        assert abs(count - fair) <= 0.1 * fair, (engine, counts)


@pytest.mark.parametrize("engines", [2, 3, 4, 5])
def test_removing_an_engine_moves_only_its_own_images(engines):
    before = [rendezvous_hash(image_id, range(engines)) for image_id in IDS]
    for gone in range(engines):
        rest = [e for e in range(engines) if e != gone]
        after = [rendezvous_hash(image_id, rest) for image_id in IDS]
        moved = [old for old, new in zip(before, after, strict=True) if old != new]
        assert moved and set(moved) == {gone}
        assert len(moved) == before.count(gone)
        # and the gone engine's images spread over the others, not onto one
        spread = Counter(
            new for old, new in zip(before, after, strict=True) if old == gone
        )  # fmt: skip
        assert len(spread) == engines - 1


def test_calls_without_an_image_go_to_the_least_loaded_engine_in_turn():
    client = EngineClient(["ipc:///nowhere/0.sock", "ipc:///nowhere/1.sock"], None)
    first, second = client.engines
    assert [client.engine_for(None).index for _ in range(4)] == [0, 1, 0, 1]  # ties: turns
    first.in_flight = 2
    assert {client.engine_for(None).index for _ in range(4)} == {1}
    second.in_flight = 3
    assert {client.engine_for(None).index for _ in range(4)} == {0}
    # a call about an image ignores load: its embedding lives at home
    assert client.engine_for(IDS[0]).index == rendezvous_hash(IDS[0], range(2))


def test_one_engine_takes_every_call():
    client = EngineClient("ipc:///nowhere/0.sock", None)
    assert {client.engine_for(i).index for i in [*IDS[:20], None]} == {0}


def _status(ready: bool, step: int = 5, failure: str | None = None, stuck: str | None = None):
    progress = {"step": step, "of": 5, "doing": f"step {step}", "seconds": 1.0}
    return Status(ready, failure, stuck, progress, (), sam_image_size=256, pid=step)


def test_the_service_is_ready_only_when_every_engine_is():
    assert combined_status([None, None]) is None
    assert not combined_status([_status(True), None]).ready  # one has not answered
    behind = combined_status([_status(True), _status(False, step=2)])
    assert not behind.ready
    assert behind.progress["step"] == 2  # the engine furthest behind
    assert behind.sam_image_size == 256
    assert combined_status([_status(True), _status(True)]).ready
    broken = combined_status([_status(True), _status(False, failure="start-up failed: X")])
    assert broken.failure == "engine-1: start-up failed: X"
    stuck = combined_status([_status(True, stuck="swin (130s)"), _status(True)])
    assert stuck.stuck == "engine-0: swin (130s)"
    assert combined_status([_status(False, failure="F")]).failure == "F"  # one engine: as is


NVIDIA_SMI = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0d5d2e7b-1111-2222-3333-444455556666)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-5b1c0e2a-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  0: (UUID: MIG-9a8b7c6d-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  1: (UUID: MIG-1f2e3d4c-1111-2222-3333-444455556666)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-77aa88bb-1111-2222-3333-444455556666)
"""


def test_gpus_are_counted_as_cuda_will_see_them():
    assert parse_visible("0,1") == ["0", "1"]
    assert parse_visible(" 2, 5 ") == ["2", "5"]
    assert parse_visible("") == [] and parse_visible("-1") == []
    assert parse_visible("3,-1,4") == ["3"]  # CUDA stops at the first invalid entry
    assert parse_nvidia_smi(NVIDIA_SMI) == [
        "0",
        "MIG-9a8b7c6d-1111-2222-3333-444455556666",
        "MIG-1f2e3d4c-1111-2222-3333-444455556666",
        "2",
    ]
    assert parse_nvidia_smi("") == []


def test_each_engine_gets_its_own_gpu():
    auto = Settings(device="auto", engines_per_gpu=1)
    plans = plan_engines(auto, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [(p.role, dict(p.env)) for p in plans] == [
        ("engine-0", {"CUDA_VISIBLE_DEVICES": "2"}),
        ("engine-1", {"CUDA_VISIBLE_DEVICES": "3"}),
    ]
    three = plan_engines(Settings(device="cuda", engines=3), {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in three] == ["2", "3", "2"]  # shared in turn
    one = plan_engines(Settings(device="cuda", engines=1), {"CUDA_VISIBLE_DEVICES": "1,2"})
    assert [dict(p.env) for p in one] == [{"CUDA_VISIBLE_DEVICES": "1"}]
    # no GPU: one engine, nothing pinned; on the CPU any number, nothing pinned
    assert [dict(p.env) for p in plan_engines(auto, {"CUDA_VISIBLE_DEVICES": ""})] == [{}]
    cpu = plan_engines(Settings(device="cpu", engines=2), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert [dict(p.env) for p in cpu] == [{}, {}]


def test_two_engines_per_whole_gpu_one_per_mig_instance_on_a_small_host():
    def gpus_of(settings: Settings, visible: str) -> list[str]:
        return [p.env["CUDA_VISIBLE_DEVICES"] for p in plan_engines(settings, {
            "CUDA_VISIBLE_DEVICES": visible}, cores=2)]  # fmt: skip

    default = Settings(device="cuda")
    assert gpus_of(default, "0") == ["0", "0"]
    assert gpus_of(default, "2,3") == ["2", "3", "2", "3"]  # in turns: engine-0, -1 differ
    mig = "MIG-9a8b7c6d-1111-2222-3333-444455556666"
    assert gpus_of(default, f"0,{mig}") == ["0", mig, "0"]
    assert gpus_of(Settings(device="cuda", engines_per_gpu=3), "1") == ["1", "1", "1"]
    assert gpus_of(Settings(device="cuda", engines_per_gpu=1), f"1,{mig}") == ["1", mig]
    # a number of engines overrides the count per GPU; no GPU: one engine
    assert gpus_of(Settings(device="cuda", engines=1), "0,1") == ["0"]
    assert [dict(p.env) for p in plan_engines(default, {"CUDA_VISIBLE_DEVICES": ""})] == [{}]


def test_auto_puts_an_engine_per_two_cores_on_a_gpu_shared_through_mps() -> None:
    """Each engine is a GIL of its own: under MPS, auto runs one per two of the host's cores
    for the GPU, two to six; time-sliced, or with a SAM model whose engines were not
    measured that small, two."""

    def count(visible: str, cores: int, shared: bool | None = None, **settings: Any) -> list[int]:
        environ = {"CUDA_VISIBLE_DEVICES": visible}
        plans = plan_engines(
            Settings(device="cuda", **settings), environ, shared=shared, cores=cores
        )
        gpus = [p.env["CUDA_VISIBLE_DEVICES"] for p in plans]
        return [gpus.count(gpu) for gpu in visible.split(",")]

    assert count("0", 16) == [6]  # the H200 host measured: 16 cores
    assert count("0", 64) == [6]
    assert count("0", 8) == [4]
    assert count("0", 5) == [2]
    assert count("0,1", 16) == [4, 4]  # the cores are the host's, split between its GPUs
    assert count("0", 16, shared=False) == [2]  # time-sliced
    assert count("0", 16, mps="off") == [2]  # SERVE_MPS=off: planned time-sliced
    assert count("0", 16, sam_model="vit_h") == [2]
    assert count("0", 16, engines_per_gpu=3) == [3]
    mig = "MIG-9a8b7c6d-1111-2222-3333-444455556666"
    assert count(f"0,{mig}", 32) == [6, 1]


def test_auto_puts_no_more_engines_on_a_gpu_than_its_memory_holds_at_start_up() -> None:
    """Six engines warming up together on an 80 GB H100 each peaked at 11.5 GiB: a smaller
    GPU gets fewer, at least one; a count set by hand is the operator's."""
    memory = {"0": 81_559, "1": 46_068, "2": 23_034, "3": 143_771}

    def count(visible: str, **settings: Any) -> list[int]:
        plans = plan_engines(
            Settings(device="cuda", **settings),
            {"CUDA_VISIBLE_DEVICES": visible},
            shared=True,
            cores=16 * len(visible.split(",")),
            memory_of=memory.get,
        )
        gpus = [p.env["CUDA_VISIBLE_DEVICES"] for p in plans]
        return [gpus.count(gpu) for gpu in visible.split(",")]

    assert memory["0"] >= ENGINE_MEMORY_MIB * 6
    assert count("0,1,2,3") == [6, 3, 1, 6]  # an H100, an L40S, an L4, an H200
    assert count("2", sam_model="vit_h") == [1]  # time-sliced, memory bounds it too
    assert count("2", engines_per_gpu=2) == [2]  # by hand: as asked
    assert count("9") == [6]  # memory unknown: cores alone
    asked: list[str] = []  # nvidia-smi is asked only where auto counts a whole GPU
    mig = "MIG-9a8b7c6d-1111-2222-3333-444455556666"
    for settings in (Settings(device="cuda", engines_per_gpu=2), Settings(device="cuda")):
        plan_engines(settings, {"CUDA_VISIBLE_DEVICES": f"0,{mig}"}, shared=True, cores=32,
                     memory_of=lambda gpu: asked.append(gpu) or memory.get(gpu))  # fmt: skip
    assert asked == ["0"]


def test_a_gpu_s_memory_is_read_from_nvidia_smi(tmp_path, monkeypatch) -> None:
    """What `nvidia-smi -i` prints for the entry; None without the tool, on its failure,
    or on text it does not expect (a CPU machine has none: the tests above pass memory)."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"-i 0"*) echo 81559 ;; *"-i 1"*) echo "[N/A]" ;; *) exit 6 ;; esac\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert [gpu_memory_mib(gpu) for gpu in ("0", "1", "2")] == [81_559, None, None]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_memory_mib("0") is None


REPLAN = """
import json, logging, shutil, sys
from server import gpus, supervisor as module
from server.mps import MpsServer
from server.settings import Settings
from server.supervisor import Supervisor

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
gpus.available_cores = module.available_cores = lambda: 16
results = {}
for case, mps in (("own", MpsServer({}, owned=True)), ("none", None),
                  ("outside", MpsServer({}, owned=False))):
    supervisor = Supervisor(Settings(device="cuda"), "127.0.0.1", 0)
    planned = len(supervisor.plans)
    supervisor.mps = mps
    supervisor._settle_plan()
    results[case] = [planned, [p.role for p in supervisor.plans], list(supervisor.addresses)]
    supervisor.sock.close()
    shutil.rmtree(supervisor.folder)
print(json.dumps([results]))
"""


def test_without_an_mps_server_of_its_own_the_supervisor_plans_two_a_gpu(tmp_path) -> None:
    """auto counted on an MPS server of the supervisor's own; when none starts
    (`start_mps` gave None), or the one found was set up outside (the pod may hold a share
    of the GPU), the supervisor plans two a GPU again before any process starts, and the
    frontends get only the engines that run. (A process of its own: the supervisor sets
    the metrics folder before prometheus_client is imported.)"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", REPLAN], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    [results] = json.loads(done.stdout.splitlines()[-1])
    planned, roles, addresses = results["own"]  # our own MPS server: the six planned
    assert planned == 6 and len(roles) == len(addresses) == 6
    for case in ("none", "outside"):  # none, or one set up outside: two a GPU
        planned, roles, addresses = results[case]
        assert planned == 6 and roles == ["engine-0", "engine-1"], results
        assert [a.rsplit("/", 1)[1] for a in addresses] == ["engine-0.sock", "engine-1.sock"]
    assert "no MPS: 2 engines instead of 6" in done.stderr
    assert "an MPS server set up outside (a share of the GPU?): 2 engines instead of 6" in (
        done.stderr
    )
    # the operator's line: how many on each GPU, and why
    assert "engines: 6 on GPU 0 (under MPS, SERVE_ENGINES_PER_GPU=auto with 16 cores)" in (
        done.stderr
    ), done.stderr
    assert "engines: 2 on GPU 0 (time-sliced, SERVE_ENGINES_PER_GPU=auto with 16 cores)" in (
        done.stderr
    ), done.stderr
