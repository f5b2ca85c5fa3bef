"""An MPS server of the supervisor's own, so that engines sharing a GPU share it at once.

Why: two engine processes on one GPU (`SERVE_ENGINES_PER_GPU`, two by default) are two
CUDA contexts, and a GPU runs one context's kernels at a time, switching between them in
time slices. A click's decoder batch (a few ms of GPU work, on the engine's highest-
priority stream) then waits for the other engine's encoder batch, whatever its priority:
stream priorities order kernels within one context only. Under the README's mix (segment
150/s, clicks 1,000/s, classify 500/s) on an H200 with synthetic weights, the same server
served 36 / 578 / 162 ok/s time-sliced, with timeouts, and 152 / 988 / 508 ok/s with no
error under MPS (docs/BENCHMARKS.md, issue 19, 2026-11-27). With NVIDIA's Multi-Process
Service the engines become clients of one MPS server, which runs their kernels side by
side on the SMs.

`SERVE_MPS`: `auto` starts a private MPS control daemon (its pipes in the supervisor's
folder, so several services on one machine never share one) when some GPU hosts two or
more engines and `nvidia-cuda-mps-control` is on the PATH (the NVIDIA container toolkit
mounts it with the `compute` driver capability), checks that a CUDA context can be made
through it, and otherwise carries on time-sliced, saying why; `on` insists (start-up
fails with the reason); `off` never starts one. Where CUDA_MPS_PIPE_DIRECTORY is already
set (the Kubernetes device plugin's MPS sharing, or a daemon of the host's), the engines
are clients of that one and nothing is started here.

The check makes a context with the driver API through ctypes in a child process: the
supervisor never loads CUDA (its engines are spawned, and it must not hold a context).
An MPS server accepts only clients of its own user; the engines are the supervisor's
children, so they are.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from server.gpus import EnginePlan

__all__ = ["CONTROL", "MpsError", "MpsServer", "gpus_shared", "start_mps"]

log = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]
CONTROL = "nvidia-cuda-mps-control"
CONTROL_TIMEOUT_S = 30.0
# the first client of a daemon starts its MPS server: a second or two on an H200
PROBE_TIMEOUT_S = 60.0
# A primary context on device 0, through the driver API: what an engine's first CUDA call
# makes (its exit code names the step that failed; 805 is CUDA_ERROR_MPS_CONNECTION_FAILED).
# A client that cannot reach the daemon runs without MPS and says nothing, so while it
# holds the context it asks the daemon (argv[1]) for its servers: none, and it was not
# served through MPS.
PROBE = r"""
import ctypes, subprocess, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as error:
    sys.exit(f"no CUDA driver: {error}")
context, device = ctypes.c_void_p(), ctypes.c_int()
for step, call in (
    ("cuInit", lambda: cuda.cuInit(0)),
    ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), 0)),
    ("cuDevicePrimaryCtxRetain",
     lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
):
    code = call()
    if code:
        sys.exit(f"{step} failed with CUDA error {code}")
listed = subprocess.run([sys.argv[1]], input="get_server_list\n", capture_output=True,
                        text=True, timeout=30)
if not listed.stdout.split():
    sys.exit("a context was made, but not through the MPS server (it lists no server)")
"""


class MpsError(RuntimeError):
    """SERVE_MPS=on and no MPS server could serve the engines: start-up stops."""


@dataclass
class MpsServer:
    """The MPS server the engines are clients of: the variables that make them so, and
    whether it is ours to stop."""

    env: Mapping[str, str]  # CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
    owned: bool
    control: str = CONTROL
    daemon_env: Mapping[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        """Tell our daemon to quit (its server goes once its clients have): after the
        engines have exited, so no client is cut off."""
        if not self.owned:
            return
        try:
            done = _control(self.control, self.daemon_env, stdin="quit\n")
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("the MPS daemon did not take 'quit': %s", error)
            return
        if done.returncode != 0:
            log.warning("the MPS daemon did not take 'quit': %s", _said(done))
        else:
            log.info("MPS: the daemon was told to quit")


def gpus_shared(plans: Sequence[EnginePlan]) -> list[str]:
    """The GPUs (CUDA_VISIBLE_DEVICES entries) that two or more engines share."""
    counts = Counter(p.env.get("CUDA_VISIBLE_DEVICES") for p in plans)
    return sorted(gpu for gpu, n in counts.items() if gpu is not None and n > 1)


def start_mps(
    mode: Mode,
    plans: Sequence[EnginePlan],
    environ: Mapping[str, str],
    folder: Path,
    *,
    probe: Sequence[str] = (sys.executable, "-c", PROBE),
) -> MpsServer | None:
    """The MPS server the engines should use, started here when SERVE_MPS asks for one;
    None: the engines run as separate contexts (time-sliced where they share a GPU)."""
    if mode == "off":
        return None
    if "CUDA_MPS_PIPE_DIRECTORY" in environ:
        log.info("engines are clients of the MPS server at CUDA_MPS_PIPE_DIRECTORY=%s",
                 environ["CUDA_MPS_PIPE_DIRECTORY"])  # fmt: skip
        return MpsServer(env={}, owned=False)  # inherited by every child already
    shared = gpus_shared(plans)
    if mode == "auto" and (not shared or any(g.startswith("MIG-") for g in shared)):
        return None  # one engine per GPU has nothing to share; MIG slices its GPU itself
    # SERVE_MPS=on with one engine per GPU: those GPUs, as asked
    gpus = shared or sorted({g for p in plans if (g := p.env.get("CUDA_VISIBLE_DEVICES"))})
    try:
        return _start_daemon(plans, environ, folder, probe, gpus)
    except MpsError as error:
        if mode == "on":
            raise
        log.warning("SERVE_MPS=auto: %s; the engines sharing GPU %s are time-sliced instead",
                    error, ",".join(shared))  # fmt: skip
        return None


def _start_daemon(
    plans: Sequence[EnginePlan],
    environ: Mapping[str, str],
    folder: Path,
    probe: Sequence[str],
    gpus: list[str],
) -> MpsServer:
    if not gpus:
        raise MpsError("no engine has a GPU")
    path = shutil.which(CONTROL, path=environ.get("PATH"))
    if path is None:
        raise MpsError(f"{CONTROL} is not on the PATH")
    pipes, logs = folder / "mps", folder / "mps-log"
    pipes.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipes), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    # the daemon numbers the GPUs as the engines' CUDA_VISIBLE_DEVICES entries do
    order = {k: v for p in plans for k, v in p.env.items() if k == "CUDA_DEVICE_ORDER"}
    daemon_env = {**environ, **order, **env}
    try:
        started = _control(path, daemon_env, args=("-d",))
    except (OSError, subprocess.SubprocessError) as error:
        raise MpsError(f"{CONTROL} -d failed: {error}") from error
    if started.returncode != 0:
        raise MpsError(f"{CONTROL} -d failed: {_said(started)}")
    server = MpsServer(env=env, owned=True, control=path, daemon_env=daemon_env)
    first = next(p for p in plans if p.env.get("CUDA_VISIBLE_DEVICES") in gpus)
    try:
        checked = subprocess.run(
            [*probe, path], env={**daemon_env, **first.env}, capture_output=True, text=True,
            timeout=PROBE_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        server.stop()
        raise MpsError(f"no CUDA context through the MPS server: {error}") from error
    if checked.returncode != 0:
        server.stop()
        tail = _log_tail(logs / "control.log")
        raise MpsError(f"no CUDA context through the MPS server: {_said(checked)}{tail}")
    log.info("MPS: the engines on GPU %s run side by side (a private daemon, pipes in %s)",
             ",".join(gpus), pipes)  # fmt: skip
    return server


def _control(
    path: str, env: Mapping[str, str], *, args: Sequence[str] = (), stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [path, *args], env=dict(env), input=stdin, capture_output=True, text=True,
        timeout=CONTROL_TIMEOUT_S, check=False,
    )  # fmt: skip


def _said(done: subprocess.CompletedProcess[str]) -> str:
    words = (done.stderr or done.stdout or "").strip().splitlines()
    return f"exit {done.returncode}" + (f": {words[-1][:300]}" if words else "")


def _log_tail(path: Path) -> str:
    """The daemon's last words, for the message (it logs why it refused a client)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f" (MPS log: {lines[-1][:300]})" if lines else ""
