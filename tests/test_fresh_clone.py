"""A newcomer's first hour: a clone with nothing beside it (no ../shared) runs a quick part of
the suite with the README's test command.

What it clones is what is committed: HEAD of this checkout (uncommitted changes are not in
it), into an empty temporary folder, where the README's pytest command runs a few test files
in place of the whole suite. The interpreter is the one running this test: in CI the
virtualenv that the README's test line, run verbatim on a clean clone, has just installed
(.ci/run), so the install itself is CI's first step. Until 2026-11-30 this test installed the
clone again into a virtualenv of its own, the same line without `apt-get`: 85 s of CI's 1,000
(3 GB of wheels unpacked) that proved only what CI's first step proves. The clone's code,
not the installed checkout's, must be what its tests import (`python -m pytest` puts the
clone first on sys.path; an editable install's finder comes after). Deselected by default,
as it runs the suite's own files a second time; CI runs it as its own step
(`python -m pytest -q -m fresh_clone`, see .ci/run).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.conftest import ROOT
from tests.test_readme import readme_test_line

pytestmark = pytest.mark.fresh_clone

# models, the real photos, and one real `python -m server`
QUICK = [
    "tests/models/test_swin_transforms.py",
    "tests/models/test_sam_transforms.py",
    "tests/server/test_imaging.py",
    "tests/server/test_api_service.py::test_python_dash_m_server_serves",
]


def lone_env() -> dict[str, str]:
    """This environment less any Python path and service settings: only the clone's own
    files and the installed packages reach its tests."""
    dropped = ("PYTHONPATH", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("SERVE_")}


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def test_a_lone_clone_passes_its_quick_tests(tmp_path: Path) -> None:
    command = readme_test_line().split("&&")[-1].strip()
    assert command.startswith("python -m pytest -q"), command

    head = git("rev-parse", "HEAD")
    alone = tmp_path / "alone"
    alone.mkdir()
    clone = alone / "sam-swin-serve"
    git("clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone))
    git("checkout", "--quiet", "--detach", head, cwd=clone)
    assert list(alone.iterdir()) == [clone], "nothing beside the clone (no ../shared)"

    # the README's command and options, with this interpreter as its `python`
    args = [sys.executable, *shlex.split(command)[1:], "-p", "no:cacheprovider", *QUICK]
    log = tmp_path / "lone.log"
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(args, cwd=clone, env=lone_env(), stdout=out,
                              stderr=subprocess.STDOUT, timeout=600)  # fmt: skip
    output = log.read_text()
    tail = output[-6000:]
    took = time.monotonic() - started
    assert proc.returncode == 0, f"{args}\nexited {proc.returncode} after {took:.0f} s:\n{tail}"
    summary = output.strip().splitlines()[-1]
    # none failed, errored or skipped
    assert re.match(r"^\d+ passed(, \d+ warnings?)? in ", summary), summary

    # what those tests imported: the clone's code, ahead of the installed checkout's
    show = "import server, tests; print(server.__file__, tests.__file__)"
    where = subprocess.run([sys.executable, "-c", show], cwd=clone, env=lone_env(),
                           capture_output=True, text=True, check=True)  # fmt: skip
    for path in where.stdout.split():
        assert Path(path).is_relative_to(clone), where.stdout
