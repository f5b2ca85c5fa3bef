"""The README's `kubectl apply -k` lines state what the rendered manifests need first.

Each prerequisite is derived from the render, not listed by hand: a namespace the objects
go to, an image name with no registry, a CRD kind, a claim that relies on the default
storage class, a GPU resource. If a manifest gains one, the README must say so.
"""

from __future__ import annotations

import re

import pytest

from tests.deploy.conftest import REPO, TARGETS, Manifest

README = (REPO / "README.md").read_text()
APPLIED = sorted(set(re.findall(r"kubectl apply -k (k8s/\S+?)`", README)))


def containers(objects: list[Manifest]) -> list[dict]:
    found = []
    for o in objects:
        spec = o.get("spec", {})
        pod = spec.get("template", {}).get("spec", spec)
        found += pod.get("containers", []) + pod.get("initContainers", [])
    return found


def target_of(path: str) -> str:
    (name,) = [n for n, p in TARGETS.items() if p == REPO / path]
    return name


def test_the_readme_applies_the_overlays_and_kserve():
    assert APPLIED == ["k8s/kserve", "k8s/overlays/gpu"], APPLIED
    assert "`k8s/overlays/cpu`" in README


@pytest.mark.parametrize("path", [*APPLIED, "k8s/overlays/cpu", "k8s/overlays/gpu-shared"])
def test_each_prerequisite_of_the_render_is_stated(rendered, path):
    objects = rendered[target_of(path)]
    for namespace in {o["metadata"].get("namespace") for o in objects} - {None}:
        assert f"kubectl create namespace {namespace}" in README
    for image in {c["image"] for c in containers(objects)}:
        if "/" not in image.split(":")[0]:  # a local name: no registry host
            assert "kustomize edit set image sam-swin-serve=REGISTRY/" in README, image
            assert "kind load docker-image" in README
    kinds = {o["kind"] for o in objects}
    if "ServiceMonitor" in kinds:
        assert "ServiceMonitor CRD" in README
    for claim in (o for o in objects if o["kind"] == "PersistentVolumeClaim"):
        if "storageClassName" not in claim["spec"]:
            assert "default storage class" in README
            for mode in claim["spec"]["accessModes"]:
                assert f"`{mode}`" in README
    limits = [c.get("resources", {}).get("limits", {}) for c in containers(objects)]
    if any("nvidia.com/gpu" in lim for lim in limits):
        assert "NVIDIA device plugin" in README and "nvidia.com/gpu.present=true" in README
    if any(o["apiVersion"].startswith("serving.kserve.io/") for o in objects):
        assert "needs KServe" in README
