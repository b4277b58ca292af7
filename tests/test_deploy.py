"""deploy/kubernetes: every manifest is valid against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors too), and the pieces agree with each
other and with kvserve: the gateway lists exactly the StatefulSet's pods, probes and
Prometheus annotations point at real routes and ports, and the gateway's arguments parse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is a test dependency (pyproject.toml)")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in _documents() if d["kind"] == kind}


def test_manifests_exist():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in _documents()}
    assert {("StatefulSet", "kvserve-replica"), ("Service", "kvserve-replica"),
            ("Deployment", "kvserve-gateway"), ("Service", "kvserve"),
            ("Deployment", "kvserve-redis"), ("Service", "kvserve-redis"),
            ("ConfigMap", "kvserve-tiers"), ("PersistentVolumeClaim", "kvserve-models")} <= kinds


@pytest.mark.parametrize("name,doc", _documents(),
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in _documents()])
def test_manifest_is_valid_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_an_invalid_manifest_is_caught():
    """The validator is really checking: a typo'd field and a wrong type both fail."""
    bad = _by_kind("Deployment")["kvserve-gateway"]
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = _by_kind("Deployment")["kvserve-gateway"]
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def test_the_gateway_lists_every_replica_pod_and_its_args_parse():
    from kvserve.cli import route_parser

    sts = _by_kind("StatefulSet")["kvserve-replica"]
    gw = _by_kind("Deployment")["kvserve-gateway"]
    args = _container(gw)["args"]
    assert args[0] == "route"
    parsed = route_parser().parse_args(args[1:])
    svc = sts["spec"]["serviceName"]
    port = _container(sts)["ports"][0]["containerPort"]
    assert parsed.replica == [f"http://{sts['metadata']['name']}-{i}.{svc}:{port}"
                              for i in range(sts["spec"]["replicas"])]
    assert _by_kind("Service")[svc]["spec"]["clusterIP"] == "None"
    assert parsed.policy == "cache_aware"


def test_replicas_parse_and_share_the_redis_tier():
    from kvserve.cli import build_parser
    from kvserve.kv.tiers.config import TierConfig

    sts = _by_kind("StatefulSet")["kvserve-replica"]
    args = _container(sts)["args"]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.kv_tier_config == "/etc/kvserve/tiers.yaml"
    tiers = yaml.safe_load(_by_kind("ConfigMap")["kvserve-tiers"]["data"]["tiers.yaml"])
    TierConfig(**tiers)  # valid keys and values
    redis = _by_kind("Service")["kvserve-redis"]
    assert tiers["remote_url"] == \
        f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"


@pytest.mark.parametrize("kind,name", [("StatefulSet", "kvserve-replica"),
                                       ("Deployment", "kvserve-gateway")])
def test_readiness_on_health_and_prometheus_annotations(kind, name):
    workload = _by_kind(kind)[name]
    c = _container(workload)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    port = c["ports"][0]["containerPort"]
    ann = workload["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(port) and ann["prometheus.io/path"] == "/metrics"
    assert f"{port}" in c["args"]  # the process listens where the probes and scrapes look
