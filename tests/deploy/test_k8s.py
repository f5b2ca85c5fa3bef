"""Kubernetes manifests: rendered with kustomize, validated against the API schemas, and
checked for the properties the service depends on (probes, drain, security, GPU, autoscaling).

Built-in kinds are validated with kubernetes-validate (strict: unknown fields are errors)
against an older and the newest Kubernetes it knows. ServiceMonitor is a CRD (Prometheus
Operator), absent from those schemas, so it is checked structurally here instead.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from server.__main__ import SHUTDOWN_GRACE_S
from server.metrics import Metrics
from server.settings import Settings
from tests.deploy.conftest import K8S, Manifest

ROOT = Path(__file__).resolve().parents[2]
GPU_SHARED = K8S / "overlays" / "gpu-shared"
TIME_SLICING = GPU_SHARED / "device-plugin-time-slicing.yaml"

KUBERNETES_VERSIONS = ("1.30", latest_version())
CRD_GROUPS = ("monitoring.coreos.com/",)
APP = "sam-swin-serve"
OVERLAYS = ("base", "gpu", "cpu", "gpu-shared", "gpu-aot")
DEPLOYED = {  # kinds each render must hold (the cpu overlay drops shared storage and CRDs)
    "base": {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
             "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"},
    "gpu": {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
            "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"},
    "gpu-shared": {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
                   "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"},
    "gpu-aot": {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
                "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"},
    "cpu": {"ConfigMap", "Service", "Deployment", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"},
}  # fmt: skip


def one(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(objects: list[Manifest]) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, "Deployment", APP)["spec"]["template"]["spec"]
    return spec


def server_container(objects: list[Manifest]) -> dict[str, Any]:
    containers = pod_spec(objects)["containers"]
    assert [c["name"] for c in containers] == ["server"], "one server container per pod"
    server: dict[str, Any] = containers[0]
    return server


def config(objects: list[Manifest]) -> dict[str, str]:
    """The SERVE_ settings of the ConfigMap the Deployment really references."""
    ref = server_container(objects)["envFrom"][0]["configMapRef"]["name"]
    data: dict[str, str] = one(objects, "ConfigMap", ref)["data"]
    return data


def settings_from(data: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Parse the ConfigMap exactly as the container will: from the environment."""
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    return Settings()  # type: ignore[call-arg]  # defaults via Field(); no pydantic mypy plugin


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (500m, 2, 8Gi, 1G) as a number."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert match, f"bad quantity {value!r}"
    return float(match.group(1)) * units.get(match.group(2), 1.0)


# -- schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [*OVERLAYS, "adapter"])
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_objects_match_the_kubernetes_schemas(rendered, target, version):
    errors = []
    for obj in rendered[target]:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {path}: {exc.message}")
    assert not errors, f"{target} against Kubernetes {version}:\n" + "\n".join(errors)


# The ServiceMonitor fields we use, as the Prometheus Operator's CRD defines them.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^\d+[smh]$"},
                            "scrapeTimeout": {"type": "string", "pattern": r"^\d+[smh]$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("target", ["base", "gpu", "gpu-shared"])
def test_service_monitor_scrapes_the_metrics_port(rendered, target):
    objects = rendered[target]
    monitor = one(objects, "ServiceMonitor", APP)
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = one(objects, "Service", APP)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), "selects our Service"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    assert monitor["metadata"].get("namespace") == service["metadata"].get("namespace")


@pytest.mark.parametrize("target", OVERLAYS)
def test_renders_the_expected_objects_and_no_secret(rendered, target):
    kinds = {o["kind"] for o in rendered[target]}
    assert kinds == DEPLOYED[target]
    # SERVE_API_KEY comes from a Secret the operator creates; none is committed.
    assert all(o["kind"] != "Secret" for objects in rendered.values() for o in objects)


# -- the pod ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", OVERLAYS)
def test_probes_cover_load_and_warm_up(rendered, target):
    server = server_container(rendered[target])
    port = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert port == {"http": 8000}
    assert server["args"] == ["--host", "0.0.0.0", "--port", "8000"]  # one uvicorn worker
    startup, ready, live = (server[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"] == {"path": "/readyz", "port": "http"}
    assert ready["httpGet"] == {"path": "/readyz", "port": "http"}
    assert live["httpGet"] == {"path": "/healthz", "port": "http"}
    # a cold compile cache can take ~10 minutes of loading, compiling and warm-up
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    for probe in (startup, ready, live):
        assert probe["timeoutSeconds"] < probe["periodSeconds"]


# The engine's close after the drain: the batch running then finishes (a GPU batch takes
# well under a second; this is the margin for it and for the process to exit).
CLOSE_MARGIN_S = 5


@pytest.mark.parametrize("target", OVERLAYS)
def test_termination_grace_outlasts_pre_stop_and_drain(rendered, target, monkeypatch):
    """The shutdown sum of server/__main__.py, from the rendered manifests and the settings
    they give: preStop, then SIGTERM -> the drain (its timeout, counted once) -> uvicorn's
    grace for what still runs -> the engine's close, all before Kubernetes' SIGKILL. And a
    request accepted before SIGTERM, a stalled upload included (408 at its deadline), is
    answered within the drain: the deadline is no longer than the drain timeout."""
    objects = rendered[target]
    server = server_container(objects)
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s >= 5, "long enough for the endpoints to drop the pod"
    settings = settings_from(config(objects), monkeypatch)
    assert settings.request_timeout_s <= settings.drain_timeout_s, (
        "a request (its body included) must be answered within the drain, not cut by SIGKILL"
    )
    needed = pre_stop_s + settings.drain_timeout_s + SHUTDOWN_GRACE_S + CLOSE_MARGIN_S
    assert pod_spec(objects)["terminationGracePeriodSeconds"] >= needed


@pytest.mark.parametrize("target", OVERLAYS)
def test_runs_locked_down_as_the_image_user(rendered, target, dockerfile_uid):
    spec = pod_spec(rendered[target])
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == dockerfile_uid
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"] + spec.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["readOnlyRootFilesystem"] is True, container["name"]
        assert sc["runAsNonRoot"] is True, container["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]


@pytest.mark.parametrize("target", OVERLAYS)
def test_writable_paths_are_tmp_and_the_compile_cache(rendered, target):
    spec = pod_spec(rendered[target])
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["tmp"]
    server = server_container(rendered[target])
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/weights", "/cache", "/dev/shm"}
    assert mounts["/weights"]["readOnly"] is True
    # the frontends' pixel files for the engine: memory, bounded (a container's own is 64 MiB)
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/cache/")
    assert env["TRITON_CACHE_DIR"].startswith("/cache/")
    for container in spec.get("initContainers", []):
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
    claims = {
        o["metadata"]["name"] for o in rendered[target] if o["kind"] == "PersistentVolumeClaim"
    }
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert used == claims, "every claim used is rendered, and every rendered claim is used"


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_container_has_requests_and_limits(rendered, target):
    spec = pod_spec(rendered[target])
    for container in spec["containers"] + spec.get("initContainers", []):
        resources = container["resources"]
        for kind in ("cpu", "memory"):
            request, limit = resources["requests"][kind], resources["limits"][kind]
            assert quantity(request) <= quantity(limit), f"{container['name']} {kind}"


def test_gpu_overlay_takes_one_whole_gpu_on_gpu_nodes(rendered, monkeypatch):
    objects = rendered["gpu"]
    spec = pod_spec(objects)
    resources = server_container(objects)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    settings = settings_from(config(objects), monkeypatch)
    assert (settings.device, settings.precision) == ("cuda", "auto")  # SAM bf16, Swin fp16
    assert (
        settings.sam_checkpoint is not None
        and settings.sam_checkpoint.parent.as_posix() == "/weights"
    )
    assert (
        settings.swin_checkpoint is not None
        and settings.swin_checkpoint.parent.as_posix() == "/weights"
    )
    assert one(objects, "Deployment", APP)["spec"]["template"]["spec"]["containers"][0][
        "image"
    ].endswith(":gpu")


def test_gpu_aot_overlay_is_the_gpu_one_with_packages_on_the_cache_volume(rendered, monkeypatch):
    aot, gpu = rendered["gpu-aot"], rendered["gpu"]

    def unhashed(spec: dict[str, Any]) -> str:  # the ConfigMap's name carries its hash
        return re.sub(r"(sam-swin-serve-config)-[a-z0-9]+", r"\1", json.dumps(spec))

    assert unhashed(pod_spec(aot)) == unhashed(pod_spec(gpu))  # only the settings differ
    settings = settings_from(config(aot), monkeypatch)
    assert settings.compile_mode == "aot"
    mounts = {m["name"]: m["mountPath"] for m in server_container(aot)["volumeMounts"]}
    # the packages (and inductor's caches) live on the shared, persistent volume
    assert settings.compile_cache_dir is not None
    assert settings.compile_cache_dir.as_posix() == mounts["compile-cache"]
    volumes = {v["name"]: v for v in pod_spec(aot)["volumes"]}
    assert "persistentVolumeClaim" in volumes["compile-cache"]
    others = {k: v for k, v in config(aot).items() if not k.startswith("SERVE_COMPILE_")}
    assert others == config(gpu)


def test_cpu_overlay_is_small_and_needs_no_gpu(rendered, monkeypatch):
    objects = rendered["cpu"]
    resources = server_container(objects)["resources"]
    assert "nvidia.com/gpu" not in resources["limits"] | resources["requests"]
    assert "nodeSelector" not in pod_spec(objects)
    settings = settings_from(config(objects), monkeypatch)
    assert settings.device == "cpu"
    assert settings.max_batch_size <= 2 and max(settings.batch_buckets) <= 2
    assert settings.sam_checkpoint is None  # seeded random weights are fine on a laptop


@pytest.mark.parametrize("target", OVERLAYS)
def test_config_map_holds_only_real_settings(rendered, target, monkeypatch):
    data = config(rendered[target])
    known = {f"SERVE_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= known, f"unknown settings: {sorted(set(data) - known)}"
    settings_from(data, monkeypatch)  # and they parse
    env = {e["name"]: e for e in server_container(rendered[target])["env"]}
    key = env["SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key["optional"] is True and "SERVE_API_KEY" not in data


@pytest.mark.parametrize("target", OVERLAYS)
def test_service_and_budget_select_the_pods(rendered, target):
    objects = rendered[target]
    labels = one(objects, "Deployment", APP)["spec"]["template"]["metadata"]["labels"]
    service = one(objects, "Service", APP)
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http"}
    budget = one(objects, "PodDisruptionBudget", APP)
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "maxUnavailable" in budget["spec"], "a drain may proceed even with one replica"


# -- autoscaling ------------------------------------------------------------------------------


def exported_families() -> dict[str, Any]:
    """Metric families the service really exports, by name."""
    return {family.name: family for family in Metrics().registry.collect()}


def adapter_rules(rendered: dict[str, list[Manifest]]) -> list[dict[str, Any]]:
    data = one(rendered["adapter"], "ConfigMap", "prometheus-adapter")["data"]
    rules: list[dict[str, Any]] = yaml.safe_load(data["config.yaml"])["rules"]
    return rules


def test_adapter_rule_serves_the_queue_depth_gauge(rendered):
    families = exported_families()
    rules = adapter_rules(rendered)
    assert rules, "the adapter config holds rules"
    for rule in rules:
        series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        family = families.get(series.group(1))
        assert family is not None, f"{series.group(1)} is not exported by server.metrics"
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]
        assert re.match(rule["name"]["matches"], series.group(1))
    depth = next(r for r in rules if r["seriesQuery"].startswith("serve_queue_depth{"))
    assert families["serve_queue_depth"].type == "gauge"
    assert depth["metricsQuery"].startswith("sum(")  # every stage of the pod together


@pytest.mark.parametrize("target", OVERLAYS)
def test_hpa_scales_on_queue_depth_with_cpu_fallback(rendered, target):
    objects = rendered[target]
    hpa = one(objects, "HorizontalPodAutoscaler", APP)
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", APP)
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = hpa["spec"]["metrics"]
    pods = [m["pods"] for m in metrics if m["type"] == "Pods"]
    assert len(pods) == 1 and pods[0]["target"]["type"] == "AverageValue"
    served = {rule["name"]["as"] for rule in adapter_rules(rendered)}
    assert pods[0]["metric"]["name"] in served, "the adapter serves the metric the HPA reads"
    assert pods[0]["metric"]["name"] in exported_families()
    cpu = [m["resource"] for m in metrics if m["type"] == "Resource"]
    assert cpu == [{"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}]
    # cold pods take minutes: never scale down in a hurry
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("target", ["gpu", "gpu-shared"])
def test_gpu_init_container_fetches_with_the_weights_command(rendered, target):
    (init,) = pod_spec(rendered[target])["initContainers"]
    script = " ".join(init["args"])
    assert "python -m models.weights download" in script
    for name in ("SERVE_SAM_CHECKPOINT", "SERVE_SWIN_CHECKPOINT"):
        assert f'[ -s "${name}" ] ||' in script, "skips the download when the file is there"
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert not mounts["/weights"].get("readOnly"), "the init container writes the weights"
    # the command the init container runs exists and knows the names it is given
    help_text = subprocess.run(
        [sys.executable, "-m", "models.weights", "download", "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "--dest" in help_text


# -- several replicas per GPU (time-slicing) -----------------------------------------------


def time_slicing_configs() -> tuple[Manifest, dict[str, dict[str, Any]]]:
    """The device plugin's ConfigMap and each config it holds, parsed."""
    (config_map,) = [doc for doc in yaml.safe_load_all(TIME_SLICING.read_text()) if doc]
    configs = {key: yaml.safe_load(text) for key, text in config_map["data"].items()}
    return config_map, configs


def shared_resources(config: dict[str, Any]) -> dict[str, int]:
    """Resource name as advertised -> shares per GPU, for one device plugin config."""
    slicing = config.get("sharing", {}).get("timeSlicing", {})
    suffix = ".shared" if slicing.get("renameByDefault", False) else ""
    return {r["name"] + suffix: r["replicas"] for r in slicing.get("resources", [])}


def test_gpu_shared_overlay_takes_one_time_sliced_share(rendered, monkeypatch):
    objects = rendered["gpu-shared"]
    spec = pod_spec(objects)
    resources = server_container(objects)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    # about 4 cores each: the measured share (4 processes on a 16-core host)
    assert quantity(resources["requests"]["cpu"]) == 4
    assert 4 <= quantity(resources["limits"]["cpu"]) <= 8
    assert quantity(resources["requests"]["memory"]) >= 4 * 2**30
    # on time-slicing GPU nodes only, tolerating the GPU taint as the gpu overlay does
    assert spec["nodeSelector"] == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    settings = settings_from(config(objects), monkeypatch)
    assert settings.decode_threads == 4
    assert (settings.device, settings.precision) == ("cuda", "auto")  # SAM bf16, Swin fp16
    assert settings.embedding_cache_bytes == 2 * 2**30, "the ~7.7 GiB was measured at"
    assert settings.sam_checkpoint is not None and settings.swin_checkpoint is not None
    assert spec["containers"][0]["image"].endswith(":gpu")
    # a surge pod finds no free share when all are taken: a rollout may take one pod down
    deployment = one(objects, "Deployment", APP)
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] >= 1


def test_gpu_shared_leaves_the_gpu_overlay_untouched(rendered, monkeypatch):
    """The new overlay changes only its own render: the whole-GPU overlay is as before."""
    gpu = rendered["gpu"]
    assert "nvidia.com/gpu.sharing-strategy" not in pod_spec(gpu)["nodeSelector"]
    assert settings_from(config(gpu), monkeypatch).embedding_cache_bytes == 4 * 2**30
    strategy = one(gpu, "Deployment", APP)["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_time_slicing_config_map_gives_four_shares_of_nvidia_gpu():
    config_map, configs = time_slicing_configs()
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(config_map, version, strict=True)
    assert config_map["kind"] == "ConfigMap"
    # the device plugin's namespace, never ours
    assert config_map["metadata"]["namespace"] not in ("", "sam-swin")
    assert all(c["version"] == "v1" for c in configs.values())
    # nodes without the nvidia.com/device-plugin.config label keep whole GPUs
    assert "sharing" not in configs["default"]
    shared = configs["time-sliced-4"]
    assert shared["sharing"]["timeSlicing"]["resources"] == [
        {"name": "nvidia.com/gpu", "replicas": 4}
    ]
    assert shared["sharing"]["timeSlicing"]["failRequestsGreaterThanOne"] is True


def test_gpu_shared_requests_the_resource_the_device_plugin_advertises(rendered):
    _, configs = time_slicing_configs()
    advertised = shared_resources(configs["time-sliced-4"])
    requested = server_container(rendered["gpu-shared"])["resources"]["requests"]
    gpu_resources = {name for name in requested if name.startswith("nvidia.com/")}
    assert gpu_resources == set(advertised), "renameByDefault and the request agree"
    # one GPU's shares: the HPA's ceiling as shipped
    hpa = one(rendered["gpu-shared"], "HorizontalPodAutoscaler", APP)
    assert hpa["spec"]["maxReplicas"] == advertised["nvidia.com/gpu"]


def test_time_slicing_config_map_is_applied_apart_from_the_overlay(rendered):
    kustomization = yaml.safe_load((GPU_SHARED / "kustomization.yaml").read_text())
    assert TIME_SLICING.name not in kustomization.get("resources", [])
    assert kustomization["resources"] == ["../gpu"], "builds on the gpu overlay"
    config_map, _ = time_slicing_configs()
    names = {o["metadata"]["name"] for o in rendered["gpu-shared"] if o["kind"] == "ConfigMap"}
    assert config_map["metadata"]["name"] not in names
