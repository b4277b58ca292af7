"""The capacity planner behind `kvserve plan`: KV memory per token and per request for MHA, GQA,
MQA, MLA and sliding-window models, weights by format, the KV pool a GPU leaves, maximum
concurrency, fragmentation, and plots. Pure arithmetic: no torch, no model loading."""

from kvserve.planner.memory import (KV_DTYPES, fragmentation, kv_bytes_per_request,
                                    kv_bytes_per_token, kv_bytes_per_token_layer, make_plan,
                                    max_concurrency, weight_bytes)
from kvserve.planner.model import ModelSpec

__all__ = ["KV_DTYPES", "ModelSpec", "fragmentation", "kv_bytes_per_request", "kv_bytes_per_token",
           "kv_bytes_per_token_layer", "make_plan", "max_concurrency", "weight_bytes"]
