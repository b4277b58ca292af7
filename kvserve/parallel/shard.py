"""Which slice of each checkpoint tensor a tensor-parallel rank reads.

A rank's model is an ordinary model of its own, smaller config (layout.rank_config), so its
family's weight map already names every checkpoint tensor with the rank's shapes; `shard_targets`
adds, per tensor, the range of the full tensor those shapes come from (`Target.part`), and the
loader reads only that range (safetensors' `get_slice`: the rest of the tensor is never read).

The rules follow the names transformers gives (vLLM's ColumnParallelLinear / RowParallelLinear
split the same tensors): q, k, v and gate, up (and their biases) by rows, o and down by
columns, the embedding and LM head by vocabulary rows, MLA's q_b / kv_b by heads, each routed
and shared expert by its intermediate columns; everything else (norms, o and down biases, the
MoE router, MLA's latent down-projection) is replicated.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from kvserve.models.base import Target
from kvserve.parallel.layout import RankLayout, split

_ROWS_BY_Q_HEAD = re.compile(r".*self_attn\.(q_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_ROWS_BY_KV_HEAD = re.compile(r".*self_attn\.[kv]_proj\.(weight|bias)$")
_COLS_BY_Q_HEAD = re.compile(r".*self_attn\.o_proj\.weight$")
_MLP_ROWS = re.compile(r".*\.mlp\.(gate_proj|up_proj)\.(weight|bias)$")
_MLP_COLS = re.compile(r".*\.mlp\.down_proj\.weight$")
_EXPERT_ROWS = re.compile(r".*\.mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj)\.weight$")
_EXPERT_COLS = re.compile(r".*\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _part(name: str, local: tuple[int, ...], lay: RankLayout, config: Any,
          rank_config: Any) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the full tensor this rank reads, or None (replicated)."""
    if name in _VOCAB:
        return (0, *lay.vocab)
    if _ROWS_BY_Q_HEAD.match(name):
        per = local[0] // lay.num_heads
        return (0, lay.q_heads[0] * per, lay.q_heads[1] * per)
    if _ROWS_BY_KV_HEAD.match(name) and config.mla is None:
        per = local[0] // lay.num_kv_heads
        return (0, lay.kv_heads[0] * per, lay.kv_heads[1] * per)
    if _COLS_BY_Q_HEAD.match(name):
        per = local[1] // lay.num_heads
        return (1, lay.q_heads[0] * per, lay.q_heads[1] * per)
    if _EXPERT_ROWS.match(name) or _EXPERT_COLS.match(name):
        dim = 0 if _EXPERT_ROWS.match(name) else 1
        width = config.moe.moe_intermediate_size
        if ".shared_experts." in name:
            width *= config.moe.n_shared_experts
        a, b = split(width, lay.world_size, lay.rank)
        if b - a != local[dim]:
            raise ValueError(f"tensor parallelism cannot split {name}: its {width} columns "
                             f"over {lay.world_size} ranks do not match the experts' split")
        return (dim, a, b)
    if _MLP_ROWS.match(name):
        return (0, *lay.intermediate)
    if _MLP_COLS.match(name):
        return (1, *lay.intermediate)
    return None


def shard_targets(targets: dict[str, Target], lay: RankLayout, config: Any,
                  rank_config: Any) -> dict[str, Target]:
    """`targets` (the weight map of the rank's model) with each sharded tensor's `part` and
    full checkpoint `shape`."""
    out = {}
    for name, t in targets.items():
        part = _part(name, t.shape, lay, config, rank_config)
        if part is None:
            out[name] = t
            continue
        dim, start, stop = part
        if stop - start != t.shape[dim]:
            raise ValueError(f"tensor parallelism: {name}'s rank {lay.rank} part "
                             f"[{start}, {stop}) does not fill its shape {list(t.shape)}")
        full = list(t.shape)
        full[dim] = _full_size(name, dim, t.shape, lay, config)
        out[name] = replace(t, shape=tuple(full), part=part)
    return out


def _full_size(name: str, dim: int, local: tuple[int, ...], lay: RankLayout,
               config: Any) -> int:
    if name in _VOCAB:
        return config.vocab_size
    if _EXPERT_ROWS.match(name) or _EXPERT_COLS.match(name):
        width = config.moe.moe_intermediate_size
        return width * (config.moe.n_shared_experts if ".shared_experts." in name else 1)
    if _MLP_ROWS.match(name) or _MLP_COLS.match(name):
        return config.intermediate_size
    if _ROWS_BY_KV_HEAD.match(name) and config.mla is None:
        return local[0] // lay.num_kv_heads * config.num_key_value_heads
    return local[dim] // lay.num_heads * config.num_attention_heads
