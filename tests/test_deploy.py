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
    from kvserve.entrypoints.cli import route_parser

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
    from kvserve.entrypoints.cli import build_parser
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


def test_replicas_share_one_kv_auth_key():
    """Issue 63: chunks in the shared Redis carry a MAC; a pod with a key of its own would
    reject (and delete) every other pod's chunks, so all take the one key from a Secret, and
    a missing Secret stops the pod instead of splitting the tier."""
    env = {e["name"]: e for e in _container(_by_kind("StatefulSet")["kvserve-replica"])["env"]}
    ref = env["KVSERVE_KV_AUTH_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvserve-kv-auth-key", "key": "kv-auth-key"}


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


# deploy/kubernetes/multinode: one model over two nodes (tensor parallelism, docs/
# tensor_parallel.md) as a LeaderWorkerSet, the LWS controller's CRD, which kubernetes-validate
# does not know: it is checked against the CRD's own schema (vendored), its pod templates
# against the core PodTemplateSpec, and the rest of the folder (core kinds) like the files above.

MULTINODE = DEPLOY / "multinode"
LWS_SCHEMA = Path(__file__).resolve().parent / "data" / "lws_v1_schema.json"
LWS_ENV = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "leader", "LWS_WORKER_INDEX": "1"}


def _multinode() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(MULTINODE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _lws() -> dict:
    return yaml.safe_load(yaml.safe_dump(_multinode()[("LeaderWorkerSet", "kvserve-tp")]))


def _strict(schema):
    """The API server's strict field validation (kubectl's default, --validate=strict): an
    unknown field is an error. A CRD's structural schema leaves unknown fields open (the server
    prunes or, strict, rejects them), so every object schema with properties and no word on
    other fields gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: _strict(s) for name, s in v.items()} if k == "properties" else _strict(v))
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _lws_errors(doc: dict) -> list[str]:
    import json

    import jsonschema

    schema = json.loads(LWS_SCHEMA.read_text())
    assert "kubernetes-sigs/lws" in schema.pop("$comment")
    # OpenAPI v3's schema objects are JSON Schema draft 4/5 (plus x-kubernetes-* extensions,
    # which the validator ignores)
    validator = jsonschema.Draft4Validator(_strict(schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def _lws_pod(lws: dict, role: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def _lws_container(lws: dict, role: str) -> dict:
    return _lws_pod(lws, role)["spec"]["containers"][0]


def _lws_args(lws: dict, role: str) -> list[str]:
    """The container's args as the pod runs them: Kubernetes expands $(VAR) from the env vars
    the LWS controller injects (here: the values it gives a 2-pod group's worker 1)."""
    args = []
    for arg in _lws_container(lws, role)["args"]:
        for var, value in LWS_ENV.items():
            arg = arg.replace(f"$({var})", value)
        assert "$(" not in arg, f"unexpanded reference in {arg!r}"
        args.append(arg)
    return args


def test_multinode_manifests_exist():
    assert {("LeaderWorkerSet", "kvserve-tp"), ("Service", "kvserve-tp")} <= set(_multinode())


def test_leaderworkerset_is_valid_against_the_lws_crd_schema():
    lws = _lws()
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert _lws_errors(lws) == []


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_leaderworkerset_pod_templates_are_valid_pod_template_specs(role):
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
           "template": _lws_pod(_lws(), role)}
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("key", [k for k in _multinode() if k[0] != "LeaderWorkerSet"],
                         ids=lambda k: f"{k[0]}/{k[1]}")
def test_multinode_core_manifests_are_valid_against_the_kubernetes_schema(key):
    kubernetes_validate.validate(_multinode()[key], K8S_VERSION, strict=True)


def test_an_invalid_leaderworkerset_is_caught():
    """The LWS schema is really checking: a typo'd field, a wrong type, a value outside an
    enum, and a typo deep in a pod template all fail; the manifest itself passes."""
    assert _lws_errors(_lws()) == []
    bad = _lws()
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    assert any("'sise'" in e for e in _lws_errors(bad))
    bad = _lws()
    bad["spec"]["leaderWorkerTemplate"]["size"] = "two"
    assert any("leaderWorkerTemplate.size" in e for e in _lws_errors(bad))
    bad = _lws()
    bad["spec"]["startupPolicy"] = "WhenReady"
    assert any("startupPolicy" in e for e in _lws_errors(bad))
    bad = _lws()
    _lws_container(bad, "worker")["volumeMount"] = _lws_container(bad, "worker")["volumeMounts"]
    assert any("'volumeMount'" in e for e in _lws_errors(bad))
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
           "template": _lws_pod(bad, "worker")}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_leader_and_worker_args_parse_into_one_multinode_engine():
    from kvserve.entrypoints.cli import build_parser, engine_kwargs
    from kvserve.config import EngineConfig

    lws = _lws()
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size == int(LWS_ENV["LWS_GROUP_SIZE"]) == 2  # LWS_GROUP_SIZE is the group's size
    leader_args, worker_args = _lws_args(lws, "leader"), _lws_args(lws, "worker")
    assert leader_args[0] == worker_args[0] == "serve"
    leader = build_parser().parse_args(leader_args)
    worker = build_parser().parse_args(worker_args)
    for parsed, rank in ((leader, 0), (worker, 1)):
        assert parsed.command == "serve"
        assert (parsed.tensor_parallel_size, parsed.nnodes, parsed.node_rank) == (4, 2, rank)
        assert (parsed.master_addr, parsed.master_port) == ("leader", 29500)
        EngineConfig(**engine_kwargs(parsed))  # a valid split: tp a multiple of nnodes, ...
    # one engine: every flag but --node-rank agrees (the model, dtype, lengths, rendezvous)
    assert {**vars(leader), "node_rank": None} == {**vars(worker), "node_rank": None}
    # each pod has the GPUs for its node's ranks
    for role in ("leader", "worker"):
        res = _lws_container(lws, role)["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] \
            == str(leader.tensor_parallel_size // leader.nnodes)
    # the rendezvous port is the one both pods expose
    for role in ("leader", "worker"):
        ports = {p["containerPort"] for p in _lws_container(lws, role)["ports"]}
        assert leader.master_port in ports
    # the model volume is the one the rest of deploy/kubernetes fills
    pvc = next(iter(_by_kind("PersistentVolumeClaim")))
    for role in ("leader", "worker"):
        claims = [v["persistentVolumeClaim"]["claimName"]
                  for v in _lws_pod(lws, role)["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [pvc] and leader.model.startswith("/models/")


def _named_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def test_the_leader_serves_http_and_the_service_selects_it_alone():
    from kvserve.entrypoints.cli import build_parser

    lws = _lws()
    leader = _lws_container(lws, "leader")
    port = build_parser().parse_args(_lws_args(lws, "leader")).port
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert _named_port(leader, leader["readinessProbe"]["httpGet"]["port"]) == port
    ann = _lws_pod(lws, "leader")["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(port) and ann["prometheus.io/path"] == "/metrics"
    worker = _lws_container(lws, "worker")  # headless: nothing to probe or scrape
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    assert port not in {p["containerPort"] for p in worker["ports"]}
    assert "annotations" not in _lws_pod(lws, "worker").get("metadata", {})

    svc = _multinode()[("Service", "kvserve-tp")]
    (svc_port,) = svc["spec"]["ports"]
    assert _named_port(leader, svc_port["targetPort"]) == port
    # the labels the LWS controller puts on a group's pods (leaderworkerset.sigs.k8s.io/...)
    def labels(index: int) -> dict:
        return {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                "leaderworkerset.sigs.k8s.io/worker-index": str(index),
                **_lws_pod(lws, "leader" if index == 0 else "worker")["metadata"]["labels"]}
    selector = svc["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert selector.items() <= labels(0).items()
    assert not selector.items() <= labels(1).items()
