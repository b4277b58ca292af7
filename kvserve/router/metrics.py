"""The gateway's Prometheus metrics (`kvserve:router_*`), in a registry of its own so that
several gateways in one process (tests) never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    def __init__(self, policy: str) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}
        r = self.registry
        self.policy = policy
        self.requests = Counter("kvserve:router_requests", "Requests a replica answered "
                                "(any status), by replica", ["replica"], registry=r)
        self.errors = Counter("kvserve:router_errors", "Failures talking to a replica, by kind: "
                              "connect (no answer), status (502/503/504), stream_cut (a stream "
                              "broken mid-way)", ["replica", "kind"], registry=r)
        self.decisions = Counter("kvserve:router_routing_decisions", "Routing decisions by "
                                 "replica and reason (affinity, spill, least_loaded, blind)",
                                 ["replica", "policy", "reason"], registry=r)
        self.retries = Counter("kvserve:router_retries", "Attempts sent to another replica after "
                               "a failure before the first byte", registry=r)
        self.unroutable = Counter("kvserve:router_unroutable", "Requests answered 503 because "
                                  "no replica could take them", registry=r)
        self.in_flight = Gauge("kvserve:router_in_flight", "Requests in flight per replica "
                               "(the load the policies balance)", ["replica"], registry=r)
        self.healthy = Gauge("kvserve:router_replica_healthy", "1 if the replica is in the "
                             "rotation", ["replica"], registry=r)
        self.kv_events = Counter("kvserve:router_kv_events", "KV events received, by replica "
                                 "and type", ["replica", "type"], registry=r)
        self.predicted_hit_tokens = Counter(
            "kvserve:router_predicted_hit_tokens", "Prompt tokens the gateway believed cached "
            "on the replica it chose", ["replica"], registry=r)
        self.prompt_tokens = Counter("kvserve:router_keyed_tokens", "Prompt tokens covered by "
                                     "the requests' prefix keys (whole blocks)", ["replica"],
                                     registry=r)
        self.pd_prefills = Counter(
            "kvserve:router_pd_prefills", "Prefill hops of disaggregated requests (--prefill/"
            "--decode), by outcome: ok (the decode instance got kv_transfer_params), failed (it "
            "computed the prompt itself), rejected (the prefill's 4xx went to the client)",
            ["outcome"], registry=r)

    def child(self, metric, **labels):
        """`metric.labels(**labels)`, cached: prometheus_client's labels() costs tens of
        microseconds, and the gateway asks for the same few children on every request."""
        key = (id(metric), tuple(sorted(labels.items())))
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(**labels)
        return got

    def render(self) -> bytes:
        return generate_latest(self.registry)
