"""Prometheus metrics for the server, in a dedicated CollectorRegistry, under vLLM's metric names
with the `kvserve:` prefix.

`PrometheusStatLogger` is a `StatLogger` of the AsyncLLMEngine: it runs on the engine loop
thread after every step, with the step's `EngineStats` snapshot and outputs (prometheus_client's
metrics are thread safe, so `/metrics` can be scraped from the asyncio thread at any time).

Latency figures per request:
* TTFT (`time_to_first_token_seconds`) and queue time (`request_queue_time_seconds`, arrival to
  first scheduled) are observed when the request's first token appears (streaming requests) or
  when it finishes (the others report only then).
* Inter-token latency: a streaming request reports after every step that gave it a token, so each
  gap is observed as it happens. A non-streaming request reports once, at the end, so its mean gap
  ((last token - first token) / (tokens - 1)) is observed once per gap.
* End-to-end latency (`e2e_request_latency_seconds`) on finish, and its parts after the queue,
  so a user can tell queueing from prefill from decode (vLLM's names): prefill time
  (`request_prefill_time_seconds`, first scheduled to first token; to finish for a prefill-only
  request), decode time (`request_decode_time_seconds`, first token to last token) and inference
  time (`request_inference_time_seconds`, first scheduled to finish).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics

from kvserve.engine.stats import EngineStats
from kvserve.kv.tenant_name import tenant_digest
from kvserve.outputs import RequestOutput

__all__ = ["PrometheusStatLogger", "CONTENT_TYPE_LATEST"]

disable_created_metrics()  # no `_created` series: vLLM's exposition has none either

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _RequestTimes:
    __slots__ = ("first_seen", "last_token_time", "num_tokens")

    def __init__(self) -> None:
        self.first_seen = False
        self.last_token_time: float | None = None
        self.num_tokens = 0


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prefix_cache_queries = counter(
            "kvserve:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "kvserve:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("kvserve:num_preemptions",
                                       "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("kvserve:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("kvserve:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = counter("kvserve:request_success",
                                       "Count of finished requests.", ["finished_reason"])
        self.kv_cache_usage = gauge("kvserve:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage (idle cached "
                                    "prefix blocks count as free).")
        self.num_running = gauge("kvserve:num_requests_running",
                                 "Number of sequences in model execution batches.")
        self.num_waiting = gauge("kvserve:num_requests_waiting",
                                 "Number of sequences waiting to be processed.")
        self.ttft = histogram("kvserve:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("kvserve:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = histogram("kvserve:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("kvserve:request_queue_time_seconds",
                                    "Histogram of time spent in the waiting queue (arrival to "
                                    "first scheduled) in seconds.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("kvserve:request_prefill_time_seconds",
                                      "Histogram of time spent in the prefill phase (first "
                                      "scheduled to first token) in seconds.", _LATENCY_BUCKETS)
        self.decode_time = histogram("kvserve:request_decode_time_seconds",
                                     "Histogram of time spent in the decode phase (first token "
                                     "to last token) in seconds.", _LATENCY_BUCKETS)
        self.inference_time = histogram("kvserve:request_inference_time_seconds",
                                        "Histogram of time spent running (first scheduled to "
                                        "finished) in seconds.", _LATENCY_BUCKETS)
        # Storage tiers (kv/tiers): labelled by where KV came from or went to.
        self.hits_by_source = counter("kvserve:prefix_cache_hits_by_source",
                                      "Prefix cache hits in tokens, by where the KV was found: "
                                      "device, host, disk, remote, or peer (another instance's "
                                      "prefill, --kv-transfer-config).", ["source"])
        self.missed_by_reason = counter("kvserve:prompt_tokens_missed",
                                        "Prompt tokens not served from the prefix cache, by the "
                                        "cache report's reason (counted for requests that ask "
                                        "for kv_cache_report).", ["reason"])
        self.tier_bytes_saved = counter("kvserve:kv_tier_bytes_saved",
                                        "Bytes of KV chunks written to a storage tier.", ["tier"])
        self.tier_bytes_loaded = counter("kvserve:kv_tier_bytes_loaded",
                                         "Bytes of KV chunks read from a storage tier.", ["tier"])
        self.tier_errors = counter("kvserve:kv_tier_errors",
                                   "Storage tier faults (unreachable, timeouts, corrupt chunks, "
                                   "I/O errors); each one was served as a miss.", ["tier", "kind"])
        self.tier_skipped_saves = counter("kvserve:kv_tier_skipped_saves",
                                          "Chunk saves skipped (budget, backlog, errors).",
                                          ["reason"])
        self.tier_load_latency = Histogram("kvserve:kv_tier_load_latency_seconds",
                                           "Time to read and check one KV chunk from a tier.",
                                           labels + ["tier"], buckets=_ITL_BUCKETS, registry=r)
        self.tier_usage = Gauge("kvserve:kv_tier_usage_bytes", "Bytes held by a storage tier.",
                                labels + ["tier"], registry=r, multiprocess_mode="mostrecent")
        # vLLM's cache_config_info: the pool as configured, in labels (value 1); and its size in
        # tokens, the figure of the start-up capacity line and of `kvserve plan`.
        self.cache_config_info = Gauge("kvserve:cache_config_info",
                                       "Information of the KV cache configuration.",
                                       labels + ["block_size", "cache_dtype", "num_gpu_blocks"],
                                       registry=r, multiprocess_mode="mostrecent")
        self.kv_cache_size_tokens = gauge("kvserve:kv_cache_size_tokens",
                                          "Tokens the KV pool holds (blocks x block size).")
        # Cache control (issue 33): pins, and idle cached blocks per tenant under quotas,
        # labelled by a digest of the tenant (a cache salt is meant to be secret). The
        # per-tenant series live in a registry of their own, rendered for the admin only:
        # /metrics is open to every caller, and a tenant's series says when it is active.
        self.tenant_registry = CollectorRegistry(auto_describe=True)
        self.num_pins = gauge("kvserve:kv_pins", "Prefixes pinned on the device (/v1/cache/pin).")
        self.pinned_blocks = gauge("kvserve:kv_pinned_blocks",
                                   "KV blocks held by pins (a block pinned twice counts once).")
        self.tenant_idle_blocks = Gauge("kvserve:kv_tenant_idle_cached_blocks",
                                        "Idle cached KV blocks per tenant (--kv-tenant-quota).",
                                        labels + ["tenant"], registry=self.tenant_registry,
                                        multiprocess_mode="mostrecent")
        self.audits = counter("kvserve:kv_audits", "Prefix-cache hit audits (--kv-audit-rate), "
                              "by event: audited_hits, audited_blocks, mismatches, "
                              "dropped_blocks, skipped.", ["event"])
        self.swaps = counter("kvserve:kv_swaps", "Preemptions by swap (--preemption-mode), by "
                             "event: swapped_out, swapped_in, resumed_on_device, and "
                             "fallback_<reason> (recomputed instead).", ["event"])
        self.swap_bytes = counter("kvserve:kv_swap_bytes", "KV bytes swapped to host swap space "
                                  "and back, by direction: out, in.", ["direction"])
        # Speculative decoding (--speculative-config), vLLM's names.
        self.spec_decode_num_drafts = counter("kvserve:spec_decode_num_drafts",
                                              "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("kvserve:spec_decode_num_draft_tokens",
                                                    "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "kvserve:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_decode_accepted_per_pos = counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", ["position"])
        # Document reuse (--blend-config): counters by event, the audits' mean divergence
        self.blend = counter("kvserve:doc_blend", "Document reuse (--blend-config), by event: "
                             "blended_requests, reused_tokens, recomputed_tokens, "
                             "computed_tokens, documents_computed, fallbacks, audits.",
                             ["event"])
        self.blend_divergence = gauge("kvserve:doc_blend_audit_divergence",
                                      "Mean KL divergence (nats) of audited blended requests' "
                                      "next-token distributions from exact ones.")
        self.blend_enabled = gauge("kvserve:doc_blend_enabled",
                                   "1 while document reuse is on, 0 once an audit turned it off.")
        self._label = {"model_name": model_name}
        labelled = {"audits", "blend", "swaps", "swap_bytes", "spec_decode_accepted_per_pos",
                    "cache_config_info", "request_success",
                    "hits_by_source",
                    "missed_by_reason", "tenant_idle_blocks",
                    "tier_bytes_saved", "tier_bytes_loaded", "tier_errors", "tier_skipped_saves",
                    "tier_load_latency", "tier_usage"}
        self._children = {name: m.labels(**self._label) for name, m in vars(self).items()
                          if isinstance(m, (Counter, Gauge, Histogram)) and name not in labelled}
        self._last_counts: dict[tuple, float] = {}
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0
        self._requests: dict[str, _RequestTimes] = {}
        self._static: tuple | None = None  # the fixed figures the info gauges were set to

    def m(self, name: str):
        return self._children[name]

    def render(self, per_tenant: bool = False) -> bytes:
        """The exposition; `per_tenant` (the admin's scrape) adds the series labelled by
        tenant."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.tenant_registry) if per_tenant else text

    # -- StatLogger -------------------------------------------------------------------------
    def _engine_gauges(self, stats: EngineStats) -> None:
        static = (stats.block_size, stats.cache_dtype, stats.num_gpu_blocks)
        if self._static != static:  # fixed once the engine is built: set once
            self._static = static
            self.cache_config_info.labels(**self._label, block_size=str(stats.block_size),
                                          cache_dtype=stats.cache_dtype,
                                          num_gpu_blocks=str(stats.num_gpu_blocks)).set(1)
            self.m("kv_cache_size_tokens").set(stats.num_gpu_blocks * stats.block_size)
        self.m("kv_cache_usage").set(stats.kv_cache_usage)
        self.m("num_running").set(stats.num_running)
        self.m("num_waiting").set(stats.num_waiting)
        # The engine's counters only grow, except a prefix-cache reset may restart them.
        q, h, p = stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions
        if q >= self._last_queries and h >= self._last_hits:
            self.m("prefix_cache_queries").inc(q - self._last_queries)
            self.m("prefix_cache_hits").inc(h - self._last_hits)
        self._last_queries, self._last_hits = q, h
        if p >= self._last_preemptions:
            self.m("num_preemptions").inc(p - self._last_preemptions)
        self._last_preemptions = p
        self.m("num_pins").set(stats.num_pins)
        self.m("pinned_blocks").set(stats.num_pinned_blocks)
        for tenant, count in stats.idle_blocks_by_tenant.items():
            self.tenant_idle_blocks.labels(**self._label, tenant=tenant_label(tenant)).set(count)
        self._grow(self.audits, stats.audits, event=None)
        swap = stats.swap
        self._grow(self.swaps, {k: v for k, v in swap.items() if not k.startswith("bytes_")},
                   event=None)
        self._grow(self.swap_bytes, {"out": swap.get("bytes_out", 0),
                                     "in": swap.get("bytes_in", 0)} if swap else {},
                   direction=None)
        self._tier_metrics(stats)
        self._spec_metrics(stats.spec_decode)
        if stats.blend:
            blend = dict(stats.blend)
            self.m("blend_divergence").set(blend.pop("audit_divergence_mean", 0.0))
            self.m("blend_enabled").set(blend.pop("enabled"))
            self._grow(self.blend, blend, event=None)

    def _spec_metrics(self, spec: dict) -> None:
        """The speculative-decoding counters ({} without speculation)."""
        if not spec:
            return
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            mark = ("spec_decode", name)
            last = self._last_counts.get(mark, 0)
            if spec[name] > last:
                self.m("spec_decode_" + name).inc(spec[name] - last)
            self._last_counts[mark] = spec[name]
        self._grow(self.spec_decode_accepted_per_pos,
                   {str(pos): n for pos, n in enumerate(spec["accepted_per_pos"])},
                   position=None)

    def _grow(self, metric: Counter, values: dict, **labels_of) -> None:
        """Add to a labelled counter what a cumulative engine count grew by since last time."""
        for key, value in values.items():
            labels = {name: part for name, part in zip(labels_of, key.split(":"))}
            mark = (id(metric), key)
            last = self._last_counts.get(mark, 0)
            if value > last:
                metric.labels(**self._label, **labels).inc(value - last)
            self._last_counts[mark] = value

    def _tier_metrics(self, stats: EngineStats) -> None:
        self._grow(self.hits_by_source, stats.hit_tokens, source=None)
        self._grow(self.missed_by_reason, stats.missed_tokens, reason=None)
        snap = stats.tier_stats
        if not snap:  # no tiers
            return
        self._grow(self.tier_bytes_saved, snap["bytes_saved"], tier=None)
        self._grow(self.tier_bytes_loaded, snap["bytes_loaded"], tier=None)
        self._grow(self.tier_errors, snap["errors"], tier=None, kind=None)
        self._grow(self.tier_skipped_saves, snap["skipped_saves"], reason=None)
        for tier, seconds in stats.tier_load_latencies:  # those since the last snapshot
            self.tier_load_latency.labels(**self._label, tier=tier).observe(seconds)
        for tier, used in stats.tier_usage.items():
            self.tier_usage.labels(**self._label, tier=tier).set(used)

    def _phase_times(self, met) -> None:
        """A finished request's time after the queue, split at its first token."""
        start = met.first_scheduled_time
        if start is None:  # aborted while waiting: it never ran
            return
        first = met.first_token_time
        self.m("prefill_time").observe(max(0.0, (first or met.finished_time) - start))
        if first is not None and met.last_token_time is not None:
            self.m("decode_time").observe(max(0.0, met.last_token_time - first))
        self.m("inference_time").observe(max(0.0, met.finished_time - start))

    def on_idle(self, stats: EngineStats) -> None:
        self._engine_gauges(stats)

    def on_request_gone(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def on_step(self, stats: EngineStats, outputs: Sequence[RequestOutput],
                streaming, now: float) -> None:
        self._engine_gauges(stats)
        for out in outputs:
            st = self._requests.get(out.request_id)
            if st is None:
                st = self._requests[out.request_id] = _RequestTimes()
            met = out.metrics
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            new_tokens = num_tokens - st.num_tokens
            if new_tokens > 0:
                self.m("generation_tokens").inc(new_tokens)
            if not st.first_seen and met.first_token_time is not None:
                st.first_seen = True
                self.m("prompt_tokens").inc(len(out.prompt_token_ids))
                self.m("ttft").observe(max(0.0, met.first_token_time - met.arrival_time))
                if met.first_scheduled_time is not None:
                    self.m("queue_time").observe(
                        max(0.0, met.first_scheduled_time - met.arrival_time))
            if out.request_id in streaming:
                if st.last_token_time is not None and met.last_token_time is not None \
                        and new_tokens > 0:
                    self.m("itl").observe(max(0.0, met.last_token_time - st.last_token_time))
            elif out.finished:
                for c in out.outputs:  # one report at the end: its mean gap, once per gap
                    gaps = len(c.token_ids) - 1
                    if gaps > 0 and met.first_token_time is not None \
                            and met.last_token_time is not None:
                        mean = max(0.0, met.last_token_time - met.first_token_time) / gaps
                        hist = self.m("itl")
                        for _ in range(gaps):
                            hist.observe(mean)
            st.num_tokens = num_tokens
            st.last_token_time = met.last_token_time
            if out.finished:
                if met.finished_time is not None:
                    self.m("e2e").observe(max(0.0, met.finished_time - met.arrival_time))
                    self._phase_times(met)
                for c in out.outputs:
                    self.request_success.labels(model_name=self._label["model_name"],
                                                finished_reason=c.finish_reason or "abort").inc()
                self._requests.pop(out.request_id, None)


def tenant_label(tenant: str) -> str:
    """A tenant's metric label: a digest, not the salt or API key itself (the prefix tree's
    name for it too)."""
    return tenant_digest(tenant) or "default"
