"""The supervisor's own MPS server (server/mps.py): when it starts one, what the engines
get, and how a machine without MPS is told apart from one where it works.

No GPU here: the control daemon is a stand-in executable of the same name that records
how it was called (the real one needs NVIDIA's driver), and the check of a CUDA context
through it is the real one, which fails here for want of libcuda, or a stand-in that
passes where a test needs the path of a machine where it works.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from server.gpus import EnginePlan, plan_engines
from server.mps import CONTROL, MpsError, gpus_shared, start_mps
from server.settings import Settings
from tests.server.conftest import free_port, spawn_server

# a check that passes when the engine would reach the daemon through its pipes
REACHES_PIPES = (sys.executable, "-c", "import os, sys; sys.exit(0 if os.path.isdir("
                 "os.environ['CUDA_MPS_PIPE_DIRECTORY']) else 'no pipes')")  # fmt: skip


def on_gpus(visible: str, per_gpu: int | str = "auto") -> list[EnginePlan]:
    return plan_engines(
        Settings(device="cuda", engines_per_gpu=per_gpu), {"CUDA_VISIBLE_DEVICES": visible}
    )


def two_on_gpu0() -> list[EnginePlan]:
    return on_gpus("0")


@pytest.fixture
def control(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH whose nvidia-cuda-mps-control writes each call (its arguments, its standard
    input, its pipe folder) to a record, and exits with the code in the file `exit`."""
    folder = tmp_path / "bin"
    folder.mkdir()
    record = tmp_path / "record"
    script = folder / CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipes=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {record}\n'
        f"code=$(cat {tmp_path}/exit 2>/dev/null || echo 0)\n"
        '[ "$code" = 0 ] || echo "An instance of this daemon is already running" >&2\n'
        'exit "$code"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}, record


def calls(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


def test_only_gpus_hosting_two_engines_are_shared():
    assert gpus_shared(two_on_gpu0()) == ["0"]
    one_each = on_gpus("0,1", per_gpu=1)
    assert gpus_shared(one_each) == []
    assert gpus_shared(plan_engines(Settings(device="cpu", engines=2), {})) == []


def test_engines_sharing_a_gpu_become_clients_of_a_private_daemon(tmp_path, control):
    environ, record = control
    server = start_mps("auto", two_on_gpu0(), environ, tmp_path, probe=REACHES_PIPES)
    assert server is not None and server.owned
    pipes = server.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert Path(pipes).is_dir() and Path(pipes).parent == tmp_path  # not the machine's
    assert Path(server.env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert calls(record) == [f"args=-d pipes={pipes} stdin="]
    server.stop()
    assert calls(record)[-1] == f"args= pipes={pipes} stdin=quit"


def test_nothing_is_started_without_a_shared_gpu_or_when_off(tmp_path, control):
    environ, record = control
    one_each = on_gpus("0", per_gpu=1)
    assert start_mps("auto", one_each, environ, tmp_path, probe=REACHES_PIPES) is None
    assert start_mps("off", two_on_gpu0(), environ, tmp_path, probe=REACHES_PIPES) is None
    mig = on_gpus("MIG-a", per_gpu=2)
    assert start_mps("auto", mig, environ, tmp_path, probe=REACHES_PIPES) is None
    assert calls(record) == []
    # on: one engine per GPU gets the daemon all the same
    assert start_mps("on", one_each, environ, tmp_path, probe=REACHES_PIPES) is not None


def test_a_daemon_set_up_outside_is_used_as_it_is(tmp_path, control):
    environ, record = control
    outside = {**environ, "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps"}
    server = start_mps("on", two_on_gpu0(), outside, tmp_path, probe=REACHES_PIPES)
    assert server is not None and not server.owned and dict(server.env) == {}
    server.stop()
    assert calls(record) == []


def test_no_cuda_context_through_it_falls_back_to_time_slicing(tmp_path, control, caplog):
    """The real check, on a machine without NVIDIA's driver: the daemon started, no
    context could be made, so it is told to quit and the engines go on without it."""
    environ, record = control
    with caplog.at_level(logging.WARNING, logger="server.mps"):
        assert start_mps("auto", two_on_gpu0(), environ, tmp_path) is None
    assert [c.split(" stdin=")[1] for c in calls(record)] == ["", "quit"]
    assert "no CUDA context through the MPS server" in caplog.text
    assert "no CUDA driver" in caplog.text and "time-sliced instead" in caplog.text
    with pytest.raises(MpsError, match="no CUDA driver"):
        start_mps("on", two_on_gpu0(), environ, tmp_path)


def test_a_daemon_that_will_not_start_is_named_with_its_reason(tmp_path, control):
    environ, _ = control
    (tmp_path / "exit").write_text("1")
    assert start_mps("auto", two_on_gpu0(), environ, tmp_path, probe=REACHES_PIPES) is None
    with pytest.raises(MpsError, match="already running"):
        start_mps("on", two_on_gpu0(), environ, tmp_path, probe=REACHES_PIPES)


def test_without_the_control_program_auto_carries_on_and_on_refuses(tmp_path):
    bare = {"PATH": str(tmp_path)}
    assert start_mps("auto", two_on_gpu0(), bare, tmp_path) is None
    with pytest.raises(MpsError, match=f"{CONTROL} is not on the PATH"):
        start_mps("on", two_on_gpu0(), bare, tmp_path)


def test_serve_mps_on_without_a_gpu_stops_start_up_with_the_reason(tmp_path):
    log_path = tmp_path / "server.log"
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_MPS": "on", "SERVE_SWIN_MODEL": "swin_test",
           "SERVE_SAM_MODEL": "vit_tiny", "SERVE_HTTP_WORKERS": "1"}  # fmt: skip
    with log_path.open("w") as log:
        proc = spawn_server(env, free_port(), log)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log_path.read_text()
    assert code == 1, text
    assert "SERVE_MPS=on: no engine has a GPU" in text
