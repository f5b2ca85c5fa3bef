"""A newcomer's first hour: a clone with nothing beside it, installed into a fresh virtualenv
as the README's test line says, runs a quick part of the suite.

What it clones is what is committed: HEAD of this checkout (uncommitted changes are not in
it), into an empty temporary folder. There it runs the README's test line without its
`apt-get` part (system packages need root; the outer run installed them) and with a few
test files in place of the whole suite. pip reads the same configuration as here (user
config, `PIP_*` variables), so torch comes from wherever `pip install torch==2.13.0` gets it
on this machine: CI's local CPU wheel. With a warm pip cache the install takes about 80 s
and 3 GB of disk, so it is deselected by default; CI runs it as its own step
(`python -m pytest -q -m fresh_clone`, see .ci/run).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.server.conftest import ROOT

pytestmark = pytest.mark.fresh_clone

# models, the real photos, and one real `python -m server`
QUICK = [
    "tests/models/test_swin_transforms.py",
    "tests/models/test_sam_transforms.py",
    "tests/server/test_imaging.py",
    "tests/server/test_api_service.py::test_python_dash_m_server_serves",
]


def readme_test_line() -> list[str]:
    """The README's second command, split at `&&`: the one that installs and tests."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "the README opens with a bash block"
    (line,) = [ln for ln in block.group(1).splitlines() if "pytest" in ln]
    return [part.strip() for part in line.split("&&")]


def newcomer_env() -> dict[str, str]:
    """This environment less any active virtualenv or Python path, and no service settings."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("SERVE_")}
    active = os.environ.get("VIRTUAL_ENV")
    if active:
        env["PATH"] = os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if Path(p) != Path(active) / "bin"
        )
    return env


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def test_a_lone_clone_installs_as_the_readme_says_and_its_tests_pass(tmp_path: Path) -> None:
    steps = readme_test_line()
    assert steps[-1].startswith("python -m pytest -q"), steps
    install = [s for s in steps[:-1] if not s.startswith("apt-get")]
    assert any(s.startswith("python3 -m venv") for s in install), "a fresh virtualenv"

    head = git("rev-parse", "HEAD")
    alone = tmp_path / "alone"
    alone.mkdir()
    clone = alone / "sam-swin-serve"
    git("clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone))
    git("checkout", "--quiet", "--detach", head, cwd=clone)
    assert list(alone.iterdir()) == [clone], "nothing beside the clone (no ../shared)"

    quick = f"{steps[-1]} -p no:cacheprovider {' '.join(QUICK)}"  # the README's options too
    command = " && ".join([*install, quick])
    log = tmp_path / "newcomer.log"
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(["bash", "-c", "set -euo pipefail; " + command], cwd=clone,
                              env=newcomer_env(), stdout=out, stderr=subprocess.STDOUT,
                              timeout=1500)  # fmt: skip
    output = log.read_text()
    tail = output[-6000:]
    took = time.monotonic() - started
    assert proc.returncode == 0, f"{command}\nexited {proc.returncode} after {took:.0f} s:\n{tail}"
    summary = output.strip().splitlines()[-1]
    # none failed, errored or skipped
    assert re.match(r"^\d+ passed(, \d+ warnings?)? in ", summary), summary

    venv_python = clone / ".venv" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import server, torch; print(server.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(clone), "the clone's code, installed"
