"""k8s/overlays/ingress-nginx and k8s/overlays/gateway-envoy: the gpu overlay behind a proxy
that hashes X-Image-Id, so every request on an image reaches the pod with its embedding.

Built-in objects (the Ingress, and all of the gpu overlay) validate strictly against the
Kubernetes schemas. The Gateway API objects and Envoy Gateway's BackendTrafficPolicy are
CRDs: SCHEMAS below are written by hand from their API references (gateway.networking.k8s.io
v1 Gateway and HTTPRoute; gateway.envoyproxy.io v1alpha1 BackendTrafficPolicy, its
`loadBalancer` as in Envoy Gateway's api/v1alpha1/loadbalancer_types.go) and cover only the
fields used here, refusing unknown ones. They are not the CRDs themselves: a field renamed
upstream would pass here and fail on apply. Then the references are followed (route to
gateway and Service port, policy to route) and the hashed header is the service's own.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from server.http.schemas import IMAGE_ID_HEADER
from server.settings import Settings
from tests.deploy.conftest import Manifest
from tests.deploy.proxy import HASH_BY
from tests.deploy.test_k8s import KUBERNETES_VERSIONS, config, one, settings_from

PROXIED = {"ingress-nginx": {"Ingress"},
           "gateway-envoy": {"Gateway", "HTTPRoute", "BackendTrafficPolicy"}}  # fmt: skip
CRD_GROUPS = ("monitoring.coreos.com/", "gateway.networking.k8s.io/", "gateway.envoyproxy.io/")
NAME = "sam-swin-serve"

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                   "labels": _STR_MAP, "annotations": _STR_MAP},
}  # fmt: skip


def _object(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                       "metadata": _METADATA, "spec": spec},
    }  # fmt: skip


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": properties}  # fmt: skip


_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}  # Gateway API's
SCHEMAS: dict[str, dict[str, Any]] = {
    "Gateway": _object("gateway.networking.k8s.io/v1", "Gateway", _closed(
        ["gatewayClassName", "listeners"],
        gatewayClassName={"type": "string", "minLength": 1},
        listeners={"type": "array", "minItems": 1, "items": _closed(
            ["name", "protocol", "port"], name={"type": "string"},
            protocol={"enum": ["HTTP", "HTTPS"]}, port=_PORT,
            hostname={"type": "string"})},
    )),
    "HTTPRoute": _object("gateway.networking.k8s.io/v1", "HTTPRoute", _closed(
        ["parentRefs", "rules"],
        parentRefs={"type": "array", "minItems": 1, "items": _closed(
            ["name"], name={"type": "string"}, namespace={"type": "string"},
            sectionName={"type": "string"})},
        hostnames={"type": "array", "items": {"type": "string"}},
        rules={"type": "array", "minItems": 1, "items": _closed(
            ["backendRefs"],
            matches={"type": "array", "items": _closed(
                [], path=_closed(["type", "value"],
                                 type={"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                 value={"type": "string", "pattern": "^/"}))},
            backendRefs={"type": "array", "minItems": 1, "items": _closed(
                ["name", "port"], name={"type": "string"}, port=_PORT,
                weight={"type": "integer", "minimum": 0})},
            timeouts=_closed([], request=_DURATION, backendRequest=_DURATION))},
    )),
    "BackendTrafficPolicy": _object("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy",
        _closed(
            ["targetRefs", "loadBalancer"],
            targetRefs={"type": "array", "minItems": 1, "items": _closed(
                ["group", "kind", "name"], group={"type": "string"},
                kind={"enum": ["Gateway", "HTTPRoute", "GRPCRoute"]}, name={"type": "string"})},
            loadBalancer=_closed(
                ["type"],
                type={"enum": ["ConsistentHash", "LeastRequest", "Random", "RoundRobin"]},
                consistentHash=_closed(
                    ["type"], type={"enum": ["SourceIP", "Header", "Cookie"]},
                    header=_closed(["name"], name={"type": "string", "minLength": 1}),
                    tableSize={"type": "integer", "minimum": 2, "maximum": 5000011})),
        ),
    ),
}  # fmt: skip


def seconds(duration: str) -> float:
    """A Gateway API duration (1h2m3s, 130s, 500ms) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", duration))


def served(objects: list[Manifest], monkeypatch: pytest.MonkeyPatch) -> Settings:
    return settings_from(config(objects), monkeypatch)


def service_port(objects: list[Manifest], port: int | str) -> None:
    """The Service of the pods has this port (a number or a name)."""
    ports = one(objects, "Service", NAME)["spec"]["ports"]
    assert any(port in (p["port"], p.get("name")) for p in ports), (port, ports)


@pytest.mark.parametrize("target", PROXIED)
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


@pytest.mark.parametrize("target", PROXIED)
def test_each_is_the_gpu_overlay_plus_its_proxy(rendered, target):
    added = [o for o in rendered[target] if o["kind"] in PROXIED[target]]
    assert sorted(o["kind"] for o in added) == sorted(PROXIED[target])
    rest = [o for o in rendered[target] if o["kind"] not in PROXIED[target]]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(rest, key=key) == sorted(rendered["gpu"], key=key)
    namespace = one(rendered[target], "Service", NAME)["metadata"]["namespace"]
    assert all(o["metadata"].get("namespace") == namespace for o in added)


def test_ingress_nginx_hashes_the_image_id_header(rendered, monkeypatch):
    objects = rendered["ingress-nginx"]
    ingress = one(objects, "Ingress", NAME)
    notes = ingress["metadata"]["annotations"]
    # nginx names a request header $http_ + its name, lower case, dashes as underscores
    assert notes["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_" + (
        IMAGE_ID_HEADER.replace("-", "_")
    )
    assert notes["nginx.ingress.kubernetes.io/upstream-hash-by"] == HASH_BY  # the tested one
    settings = served(objects, monkeypatch)
    size = re.fullmatch(r"([0-9]+)([kmg]?)", notes["nginx.ingress.kubernetes.io/proxy-body-size"])
    assert size is not None
    limit = int(size.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[size.group(2)]
    assert limit >= settings.max_body_bytes, "the proxy would refuse bodies the service takes"
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        value = float(notes[f"nginx.ingress.kubernetes.io/{timeout}"])
        assert value > settings.max_request_timeout_s, timeout
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    backend = path["backend"]["service"]
    assert backend["name"] == NAME
    service_port(objects, backend["port"].get("name") or backend["port"]["number"])


@pytest.mark.parametrize("kind", SCHEMAS)
def test_gateway_objects_match_their_api(rendered, kind):
    jsonschema.validate(one(rendered["gateway-envoy"], kind, NAME), SCHEMAS[kind])


def test_envoy_gateway_hashes_the_image_id_header_on_the_route(rendered, monkeypatch):
    objects = rendered["gateway-envoy"]
    gateway, route = one(objects, "Gateway", NAME), one(objects, "HTTPRoute", NAME)
    policy = one(objects, "BackendTrafficPolicy", NAME)
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["name"] == NAME
    service_port(objects, backend["port"])
    settings = served(objects, monkeypatch)
    assert seconds(rule["timeouts"]["request"]) > settings.max_request_timeout_s
    (target,) = policy["spec"]["targetRefs"]
    assert target == {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                      "name": route["metadata"]["name"]}  # fmt: skip
    balancer = policy["spec"]["loadBalancer"]
    assert balancer["type"] == "ConsistentHash"
    assert balancer["consistentHash"]["type"] == "Header"
    assert balancer["consistentHash"]["header"]["name"].lower() == IMAGE_ID_HEADER
