"""k8s/kserve: the ServingRuntime and InferenceService for teams that run KServe.

KServe's CRDs are not in kubernetes-validate's schemas, so the check has two halves:
- KSERVE_SCHEMAS below are written by hand from KServe's API reference (serving.kserve.io
  v1alpha1 ServingRuntime, v1beta1 InferenceService) and cover only the fields these
  manifests use, with unknown fields refused at every level they describe. They are not
  KServe's own CRD schemas: a field KServe renamed would pass here and fail on apply.
- Everything that KServe copies into the pod (the container, volumes, node selector,
  tolerations from the runtime; the pod-level fields of the predictor) is assembled into a
  Pod and validated strictly against the real Kubernetes schemas.
Then the runtime is checked against the rest of the project: the same image, user, probes
and drain as k8s/base, settings that parse, checkpoints inside the model mount.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from server.settings import Settings
from tests.deploy.conftest import Manifest
from tests.deploy.test_k8s import KUBERNETES_VERSIONS, one, server_container, settings_from

NAME = "sam-swin-serve"
MODEL_DIR = "/mnt/models"  # where KServe mounts an InferenceService's storageUri

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                   "labels": _STR_MAP, "annotations": _STR_MAP},
}  # fmt: skip
KSERVE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServingRuntime": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
            "kind": {"const": "ServingRuntime"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["supportedModelFormats", "containers"],
                "additionalProperties": False,
                "properties": {
                    "supportedModelFormats": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "version": {"type": "string"},
                                "autoSelect": {"type": "boolean"},
                                "priority": {"type": "integer", "minimum": 1},
                            },
                        },
                    },
                    "annotations": _STR_MAP,
                    "labels": _STR_MAP,
                    "containers": {"type": "array", "minItems": 1},  # core/v1 Container
                    "volumes": {"type": "array"},  # core/v1 Volume
                    "nodeSelector": _STR_MAP,
                    "tolerations": {"type": "array"},  # core/v1 Toleration
                },
            },
        },
    },
    "InferenceService": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "serving.kserve.io/v1beta1"},
            "kind": {"const": "InferenceService"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["predictor"],
                "additionalProperties": False,
                "properties": {
                    "predictor": {
                        "type": "object",
                        "required": ["model"],
                        # the predictor inlines a core/v1 PodSpec: checked as a Pod below
                        "properties": {
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 1},
                            "model": {
                                "type": "object",
                                "required": ["modelFormat"],
                                "additionalProperties": False,
                                "properties": {
                                    "modelFormat": {
                                        "type": "object",
                                        "required": ["name"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "name": {"type": "string"},
                                            "version": {"type": "string"},
                                        },
                                    },
                                    "runtime": {"type": "string"},
                                    "storageUri": {
                                        "type": "string",
                                        "pattern": "^(pvc|s3|gs|https?|hdfs)://",
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}
# The predictor fields that are KServe's own; the rest of the predictor is a PodSpec.
_KSERVE_PREDICTOR_FIELDS = {"minReplicas", "maxReplicas", "model"}


@pytest.fixture(scope="module")
def kserve(rendered: dict[str, list[Manifest]]) -> list[Manifest]:
    return rendered["kserve"]


@pytest.fixture(scope="module")
def runtime(kserve: list[Manifest]) -> Manifest:
    return one(kserve, "ServingRuntime", NAME)


@pytest.fixture(scope="module")
def isvc(kserve: list[Manifest]) -> Manifest:
    return one(kserve, "InferenceService", NAME)


def container(runtime: Manifest) -> dict[str, Any]:
    (only,) = runtime["spec"]["containers"]
    assert only["name"] == "kserve-container", "KServe finds the model server by this name"
    result: dict[str, Any] = only
    return result


def test_renders_only_the_two_kserve_objects(kserve):
    assert sorted(o["kind"] for o in kserve) == ["InferenceService", "ServingRuntime"]
    assert {o["metadata"]["namespace"] for o in kserve} == {"sam-swin"}


@pytest.mark.parametrize("kind", sorted(KSERVE_SCHEMAS))
def test_kserve_fields_match_the_hand_written_schema(kserve, kind):
    jsonschema.validate(one(kserve, kind), KSERVE_SCHEMAS[kind])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_pod_kserve_builds_matches_the_kubernetes_schema(runtime, isvc, version):
    predictor = isvc["spec"]["predictor"]
    spec = {k: v for k, v in predictor.items() if k not in _KSERVE_PREDICTOR_FIELDS}
    for field in ("containers", "volumes", "nodeSelector", "tolerations"):
        spec[field] = runtime["spec"][field]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": NAME}, "spec": spec}
    kubernetes_validate.validate(pod, version, strict=True)


def test_the_inference_service_uses_the_runtime(runtime, isvc):
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    # a raw Deployment: minutes of warm-up rule out Knative's scale-from-zero
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert isvc["spec"]["predictor"]["minReplicas"] >= 1


def test_weights_come_from_the_base_claim_at_the_model_mount(runtime, isvc, rendered):
    uri = isvc["spec"]["predictor"]["model"]["storageUri"]
    claims = {
        o["metadata"]["name"] for o in rendered["base"] if o["kind"] == "PersistentVolumeClaim"
    }
    assert uri.startswith("pvc://") and uri.removeprefix("pvc://").split("/")[0] in claims
    env = {e["name"]: e.get("value") for e in container(runtime)["env"]}
    for key in ("SERVE_SAM_CHECKPOINT", "SERVE_SWIN_CHECKPOINT"):
        assert env[key].startswith(MODEL_DIR + "/"), key


def test_settings_are_real_and_parse(runtime, monkeypatch):
    env = container(runtime)["env"]
    plain = {e["name"]: e["value"] for e in env if e["name"].startswith("SERVE_") and "value" in e}
    known = {f"SERVE_{name.upper()}" for name in Settings.model_fields}
    assert set(plain) <= known, sorted(set(plain) - known)
    settings = settings_from(plain, monkeypatch)
    assert settings.device == "cuda"
    secret = next(e for e in env if e["name"] == "SERVE_API_KEY")["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "sam-swin-serve-api-key", "key": "api-key", "optional": True}


def test_one_port_for_http_probes_and_metrics(runtime):
    c = container(runtime)
    port = int(c["args"][c["args"].index("--port") + 1])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(port)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == port, probe


def test_same_image_probes_drain_and_lockdown_as_the_gpu_overlay(
    runtime, isvc, rendered, dockerfile_uid, monkeypatch
):
    c = container(runtime)
    gpu = server_container(rendered["gpu"])
    assert c["image"] == gpu["image"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        ours = {k: v for k, v in c[probe].items() if k != "httpGet"}
        theirs = {k: v for k, v in gpu[probe].items() if k != "httpGet"}
        assert ours == theirs, probe
        assert c[probe]["httpGet"]["path"] == gpu[probe]["httpGet"]["path"], probe
    assert c["lifecycle"] == gpu["lifecycle"]
    sleep_s = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    drain_s = settings_from({"SERVE_DRAIN_TIMEOUT_S": env["SERVE_DRAIN_TIMEOUT_S"]},
                            monkeypatch).drain_timeout_s  # fmt: skip
    predictor = isvc["spec"]["predictor"]
    assert predictor["terminationGracePeriodSeconds"] > sleep_s + drain_s + 5
    assert predictor["securityContext"]["runAsUser"] == dockerfile_uid
    assert predictor["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["runAsUser"] == dockerfile_uid and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    # the only writable paths, as in k8s/base (/dev/shm: the frontends' pixel files)
    assert mounts == {"/tmp", "/cache", "/dev/shm"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
