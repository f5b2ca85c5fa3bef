"""Locust against our real server on the CPU: 4 users for 15 s, every check, zero failures.

The server is tests/server's `LiveServer` with `small_settings()` (tiny models, same code
paths); Locust runs as its own process, exactly as documented in docs/DEPLOYMENT.md.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.deploy.conftest import REPO
from tests.server.conftest import PHOTOS, LiveServer, small_settings

# Each user class makes requests under these names (AnnotatorUser: embed, then clicks).
NAMES_BY_USER = {
    "AnnotatorUser": ("/v1/embed", "/v1/segment [click]"),
    "BoxSegmentUser": ("/v1/segment [boxes]",),
    "ClassifyUser": ("/v1/classify",),
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(small_settings()).start(timeout_s=60)
    yield live
    live.stop()


def test_locust_run_has_no_failures_and_every_user_class_works(server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOADTEST_", "LOCUST_"))}
    env["LOADTEST_IMAGES"] = str(PHOTOS)
    prefix = tmp_path / "smoke"
    command = [
        sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py",
        "--headless", "-u", "4", "-r", "4", "-t", "15s", "--host", server.url,
        "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"locust exited {proc.returncode}:\n{output}"

    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0, output
    for user, names in NAMES_BY_USER.items():
        for name in names:
            assert name in rows, f"{user} made no {name} request:\n{output}"
            assert int(rows[name]["Request Count"]) > 0
            assert int(rows[name]["Failure Count"]) == 0
    with open(f"{prefix}_exceptions.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [], "no exception inside a user"
