"""Time from process start to ready, and peak memory, of `python -m server` as a user runs it.

Spawns the server with the caller's environment (no `SERVE_` variables unless given with
`--env`), polls `/readyz` every 0.2 s, and reports the seconds from spawn to the first 200
and the process's peak resident memory then (`VmHWM` in /proc, Linux). Then stops it
with SIGTERM. The machine's load average is printed too: on a shared machine it decides
the number.

    python -m bench.startup                      # the newcomer's defaults
    python -m bench.startup --env SERVE_SAM_MODEL=vit_tiny SERVE_SWIN_MODEL=swin_test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

log = logging.getLogger("bench.startup")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _peak_rss_bytes(pid: int) -> int:
    """The process's high-water resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc: Linux only")


def measure(env: dict[str, str], timeout_s: float, keep_log: Path | None) -> dict[str, object]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/readyz"
    load_before = os.getloadavg()
    # one client for every poll: a new one each time cost a busy 2-core machine a second
    # of CPU every few seconds, taken from the server being measured
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as out, httpx.Client() as client:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("the server exited:\n" + Path(out.name).read_text())
                seconds = time.monotonic() - started
                if seconds > timeout_s:
                    raise RuntimeError(f"not ready in {timeout_s:.0f} s")
                try:
                    if client.get(url, timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            peak = _peak_rss_bytes(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            finally:  # kept when the start failed too: that log says how far it got
                text = Path(out.name).read_text()
                if keep_log is not None:
                    keep_log.write_text(text)
        steps = [line for line in text.splitlines() if '"start-up ' in line]
    return {
        "ready_s": round(seconds, 1),
        "peak_rss_gib": round(peak / 1024**3, 2),
        "load_avg_1m_before": round(load_before[0], 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "steps": [json.loads(line)["message"] for line in steps],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings for the server")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--log", type=Path, help="keep the (last) server's log here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    env.update(dict(item.split("=", 1) for item in args.env))
    for _ in range(args.runs):
        log.info(json.dumps(measure(env, args.timeout, args.log)))


if __name__ == "__main__":
    main()
