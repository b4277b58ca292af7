"""`kvserve route`: a prefix-aware gateway in front of several `kvserve serve` replicas.

One concept per module:

- policies.py     which replica serves a request (shared with the simulator, kvserve/sim/replay.py)
- keys.py         a request's prefix key: the replicas' chained block hashes, from token ids
- prefix_view.py  the gateway's approximate picture of each replica's prefix cache
- replicas.py     one replica's state: health, in-flight load, counters; the health checker
- events.py       the KV-event subscriber that corrects the picture (BlockStored / BlockRemoved)
- metrics.py      the gateway's Prometheus metrics
- app.py          the FastAPI proxy (retries before the first byte, streams passed through)
- disagg.py       prefill/decode disaggregation: a prefill hop, then a decode hop with its KV
- launch.py       the command line's entry point

Nothing here imports torch, the model or the engine: a gateway is a small process.
"""
