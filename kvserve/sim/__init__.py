"""The trace-driven cache simulator behind `kvserve simulate`: request traces replayed through
kvserve's own KV-cache code (`kvserve.kv`), one cache or N replicas behind a routing policy, with
an offline Belady reference and allocation-mode comparisons."""

from kvserve.kv.eviction import EVICTION_POLICIES
from kvserve.sim.replay import SimConfig, replay
from kvserve.sim.trace import Trace, TraceRequest, from_token_lists, load_trace, write_trace

__all__ = ["EVICTION_POLICIES", "SimConfig", "Trace", "TraceRequest", "from_token_lists",
           "load_trace", "replay", "write_trace"]
