"""Which engine features do not combine, and why: one table, checked in one function.

Every refusal of a feature combination (storage tiers without prefix caching, a bounded cache
on an MLA model, int4 under per-group block tables, ...) is a row of `CONFLICTS`: the two
features and the reason the user reads. `check_features` raises the reason of the first row
whose two features are both on. `EngineConfig` checks its own fields' features at start-up
(`EngineConfig.features`), the builder adds what only the loaded model says (MLA, sliding
windows, the hybrid layout), the input processor a request's bounded cache; the KV layers
(kv/manager.py, kv/tensors.py), which may be built directly, check the same rows through
`refuse` for the pair they guard, so a message is written once, here.

Why a leaf module (it imports nothing of kvserve): the KV cache package depends on nothing
above it (tests/test_architecture.py), and it refuses combinations too.

A reason may name values only its caller knows (the model's architecture, its windowed
layers): `{name}` fields filled from the keyword arguments of `check_features` / `refuse`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The features, by name.
KV_TIERS = "kv_tiers"  # kv_tier_config (storage tiers under the pool)
NO_PREFIX_CACHING = "no_prefix_caching"  # enable_prefix_caching=False
CALCULATE_KV_SCALES = "calculate_kv_scales"  # fp8 scales taken from the first K/V
CUDA = "cuda"  # device='cuda'
TORCH_BACKEND = "torch_backend"  # attention_backend='torch' (the CPU one)
TRITON_BACKEND = "triton_backend"  # attention_backend='triton'
INT4 = "int4"  # kv_cache_dtype='int4' (KIVI: per-block residual rows)
KV_DTYPE_OTHER = "kv_dtype_other"  # a KV cache dtype other than the model's (quantized or not)
MLA = "mla"  # the model's KV is one latent vector per token (DeepSeek)
SLIDING_WINDOW = "sliding_window"  # the model has sliding-window layers
HYBRID = "hybrid"  # per-group block tables (kv/spec.py's page_groups)
RELEASED_WINDOW = "released_window"  # blocks outside a sliding window are released
BOUNDED = "bounded"  # a bounded KV cache (kv/bounded.py), engine-wide or per request
BOUNDED_BY_ATTENTION = "bounded_by_attention"  # SnapKV / H2O: select by attention weights
NO_ATTENTION_WEIGHTS = "no_attention_weights"  # a backend that computes no attention weights
SWAP = "swap"  # preemption_mode='swap' (kv/swap.py)
TENSOR_PARALLEL = "tensor_parallel"  # tensor_parallel_size > 1 (kvserve/parallel/)
QUANTIZE_AT_LOAD = "quantize_at_load"  # quantization q8_0 / q4_0 / q4_1 / q4_k
SPEC_DECODE = "spec_decode"  # speculative_config (kvserve/spec/)
SPEC_SUFFIX = "spec_suffix"  # speculative_config method 'suffix' (drafts from the prefix index)
DOC_BLEND = "doc_blend"  # blend_config: document reuse anywhere in the prompt (kvserve/blend/)
DETERMINISTIC = "deterministic"  # deterministic=True (batch- and split-invariant results)
SOFTCAP = "softcap"  # the model soft-caps its attention logits (Gemma 2)


@dataclass(frozen=True)
class Conflict:
    """Two features that cannot both be on, and why (a str.format template)."""

    a: str
    b: str
    reason: str


CONFLICTS: tuple[Conflict, ...] = (
    Conflict(KV_TIERS, NO_PREFIX_CACHING,
             "kv_tier_config needs prefix caching (enable_prefix_caching)"),
    Conflict(KV_TIERS, CALCULATE_KV_SCALES,
             "calculate_kv_scales cannot be combined with kv_tier_config (storage tiers): "
             "stored chunks need scales fixed at start-up (put k_scale/v_scale in the "
             "checkpoint)"),
    Conflict(CUDA, TORCH_BACKEND,
             "attention_backend='torch' is the CPU backend; use 'triton' (or 'auto') with "
             "device='cuda'"),
    Conflict(MLA, KV_DTYPE_OTHER,
             "kv_cache_dtype={kv_cache_dtype!r} asks for {what} KV cache dtype, but MLA models "
             "({architecture}) keep their latent cache in the model's dtype ({model_kv}): use "
             "kv_cache_dtype='auto'"),
    Conflict(INT4, TRITON_BACKEND,
             "int4 (KIVI) KV caches run on the torch backend only; the Triton kernels read fp8 "
             "and int8 caches"),
    Conflict(INT4, HYBRID,
             "int4 (KIVI) KV caches keep every block (no per-group tables)"),
    Conflict(SWAP, INT4,
             "preemption_mode='swap' cannot carry int4 (KIVI) KV: its per-block residual rows "
             "stay with the worker; use preemption_mode='recompute' or 'auto'"),
    Conflict(SWAP, BOUNDED,
             "preemption_mode='swap' does not work with a bounded KV cache (its blocks hold "
             "compacted KV); use preemption_mode='recompute' or 'auto'"),
    Conflict(HYBRID, KV_TIERS,
             "per-group block tables (a hybrid layout) do not work with storage tiers yet (a "
             "tier chunk holds every layer of a block)"),
    Conflict(RELEASED_WINDOW, KV_TIERS,
             "releasing blocks outside a sliding window does not work with storage tiers yet "
             "(a chunk would have released blocks)"),
    Conflict(BOUNDED, MLA,
             "a bounded KV cache is not supported for MLA models (their latent cache is "
             "compressed already)"),
    Conflict(BOUNDED, KV_DTYPE_OTHER,
             "a bounded KV cache needs the KV cache in the model's own dtype "
             "(kv_cache_dtype=auto), got kv_cache_dtype={kv_cache_dtype!r}: compaction and the "
             "attention weights of SnapKV/H2O read the cache unquantized"),
    Conflict(BOUNDED, SLIDING_WINDOW,
             "a bounded KV cache applies to full-attention layers only, and this model's "
             "layers {windowed} are sliding-window layers (they bound their cache already; "
             "per-group compaction is not supported)"),
    Conflict(BOUNDED, HYBRID,
             "a bounded KV cache needs one block table (per-group block tables, a hybrid "
             "layout, come from windowed layers, which bounded caches refuse)"),
    Conflict(TENSOR_PARALLEL, BOUNDED,
             "a bounded KV cache is not supported with tensor parallelism (its compaction and "
             "attention observations are one process's)"),
    Conflict(TENSOR_PARALLEL, QUANTIZE_AT_LOAD,
             "quantization at load is not supported with tensor parallelism (the quantized "
             "kernels are not sharded); a GGUF file is dequantized per rank"),
    Conflict(SPEC_DECODE, INT4,
             "speculative decoding ({method}) cannot run over an int4 (KIVI) KV cache: a "
             "rejected draft that completes a block would be quantized into it with the "
             "block's per-channel scales; use kv_cache_dtype int8 or fp8"),
    Conflict(SPEC_SUFFIX, NO_PREFIX_CACHING,
             "speculative_config method 'suffix' drafts from the prefix index, so it needs "
             "prefix caching (enable_prefix_caching); use method 'ngram' without it"),
    Conflict(SPEC_DECODE, BOUNDED,
             "speculative decoding ({method}) does not work with a bounded KV cache (its "
             "compaction would keep rejected drafts' KV)"),
    Conflict(SPEC_DECODE, TENSOR_PARALLEL,
             "speculative decoding ({method}) is not supported with tensor parallelism yet "
             "(untested across ranks)"),
    Conflict(DOC_BLEND, NO_PREFIX_CACHING,
             "document reuse (blend_config) stores documents' KV in the prefix cache, so it "
             "needs prefix caching (enable_prefix_caching)"),
    Conflict(DOC_BLEND, MLA,
             "document reuse (blend_config) re-rotates stored keys to their new positions, "
             "which MLA's latent KV (a decoupled RoPE part) does not support yet"),
    Conflict(DOC_BLEND, SLIDING_WINDOW,
             "document reuse (blend_config) places a document's whole KV, which a sliding "
             "window (layers {windowed}) would drop and could not recompute"),
    Conflict(DOC_BLEND, HYBRID,
             "document reuse (blend_config) needs one block table per request"),
    Conflict(DOC_BLEND, KV_DTYPE_OTHER,
             "document reuse (blend_config) rotates stored keys in the model's float type; "
             "kv_cache_dtype {kv_cache_dtype} stores them otherwise (use kv_cache_dtype auto)"),
    Conflict(DOC_BLEND, BOUNDED,
             "document reuse (blend_config) does not combine with a bounded KV cache (its "
             "compaction moves tokens away from the positions a placement writes)"),
    Conflict(DOC_BLEND, TENSOR_PARALLEL,
             "document reuse (blend_config) is not supported with tensor parallelism yet"),
    Conflict(DOC_BLEND, TRITON_BACKEND,
             "document reuse (blend_config) needs the attention backend to store every "
             "prefill row's K/V before any row reads it, which only the torch (CPU) backend "
             "is tested for; use attention_backend torch"),
    Conflict(DETERMINISTIC, TRITON_BACKEND,
             "deterministic inference runs on the CPU's torch attention backend (its paged "
             "kernel's per-row arithmetic); the Triton backend has no invariant prefill yet"),
    Conflict(DETERMINISTIC, INT4,
             "deterministic inference cannot run over an int4 (KIVI) KV cache: a block's keys "
             "are quantized once it fills, so a token's context depends on how the prompt was "
             "split; use kv_cache_dtype int8 or fp8"),
    Conflict(DETERMINISTIC, MLA,
             "deterministic inference is not available for MLA models ({architecture}) yet: "
             "their latent attention has no invariant prefill"),
    Conflict(DETERMINISTIC, SOFTCAP,
             "deterministic inference is not available for {architecture}: its attention "
             "logit soft-capping runs outside the paged kernel"),
    Conflict(DETERMINISTIC, TENSOR_PARALLEL,
             "deterministic inference is not supported with tensor parallelism yet (a GGUF "
             "file is dequantized per rank and float projections are not batch-invariant)"),
    Conflict(BOUNDED_BY_ATTENTION, NO_ATTENTION_WEIGHTS,
             "bounded KV policy {policy} selects by attention weights, which only the torch "
             "attention backend computes (this engine runs {backend})"),
)

_BY_PAIR = {frozenset((c.a, c.b)): c for c in CONFLICTS}
assert len(_BY_PAIR) == len(CONFLICTS), "a pair of features listed twice"


class _Context(dict):
    """A reason's fields; one its caller did not give reads as "?" (a message, never a
    KeyError in place of the refusal)."""

    def __missing__(self, key: str) -> str:
        return "?"


def _message(conflict: Conflict, context: dict[str, Any]) -> str:
    return conflict.reason.format_map(_Context(context))


def conflicts(features: Iterable[str]) -> list[Conflict]:
    """The rows of `CONFLICTS` whose two features are both in `features`, in table order."""
    on = set(features)
    return [c for c in CONFLICTS if c.a in on and c.b in on]


def check_features(features: Iterable[str], **context: Any) -> None:
    """Raise ValueError with the reason of the first conflict among `features`; `context`
    fills the reason's fields."""
    found = conflicts(features)
    if found:
        raise ValueError(_message(found[0], context))


def refuse(a: str, b: str, **context: Any) -> None:
    """Raise the table's ValueError for the pair (a, b): for a layer that has found both on
    (the pair must be a row of the table)."""
    conflict = _BY_PAIR[frozenset((a, b))]
    raise ValueError(_message(conflict, context))


def model_features(model_config: Any, kv_differs: bool, **context: Any
                   ) -> tuple[set[str], dict[str, Any]]:
    """The features a loaded model (kvserve.models.config.ModelConfig, read by attribute) turns
    on — MLA, sliding-window layers, a KV cache dtype other than the model's (`kv_differs`) —
    and the values their reasons name (with `context`)."""
    on = set()
    if model_config.mla is not None:
        on.add(MLA)
    windowed = [i for i, w in enumerate(model_config.layer_windows) if w is not None]
    if windowed:
        on.add(SLIDING_WINDOW)
    if kv_differs:
        on.add(KV_DTYPE_OTHER)
    if getattr(model_config, "attn_logit_softcapping", None) is not None:
        on.add(SOFTCAP)
    return on, {"architecture": model_config.architecture, "windowed": windowed[:8], **context}
