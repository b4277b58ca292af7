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
from kvserve.model_loader.tp_layout import RankLayout, split

_ROWS_BY_Q_HEAD = re.compile(r".*self_attn\.(q_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_ROWS_BY_KV_HEAD = re.compile(r".*self_attn\.[kv]_proj\.(weight|bias)$")
_COLS_BY_Q_HEAD = re.compile(r".*self_attn\.o_proj\.weight$")
_MLP_ROWS = re.compile(r".*\.mlp\.(gate_proj|up_proj)\.(weight|bias)$")
_MLP_COLS = re.compile(r".*\.mlp\.down_proj\.weight$")
# routed and shared experts: DeepSeek's and Qwen3-MoE's names, and Mixtral's (w1 gate, w3 up,
# w2 down)
_EXPERT_ROWS = re.compile(r".*\.mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj)\.weight$"
                          r"|.*\.block_sparse_moe\.experts\.\d+\.(w1|w3)\.weight$")
_EXPERT_COLS = re.compile(r".*\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight$"
                          r"|.*\.block_sparse_moe\.experts\.\d+\.w2\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _part(name: str, local: tuple[int, ...], lay: RankLayout, config: Any
          ) -> tuple[int, int, int, int] | None:
    """(dim, start, stop, full size on dim) of the checkpoint tensor this rank reads, or None
    (replicated)."""
    if name in _VOCAB:
        return (0, *lay.vocab, config.vocab_size)
    if _EXPERT_ROWS.match(name) or _EXPERT_COLS.match(name):
        dim = 0 if _EXPERT_ROWS.match(name) else 1
        width = config.moe.moe_intermediate_size
        if ".shared_experts." in name:
            width *= config.moe.n_shared_experts
        a, b = split(width, lay.world_size, lay.rank)
        if b - a != local[dim]:
            raise ValueError(f"tensor parallelism cannot split {name}: its {width} columns "
                             f"over {lay.world_size} ranks do not match the experts' split")
        return (dim, a, b, width)
    if _MLP_ROWS.match(name) or _MLP_COLS.match(name):
        return (0 if _MLP_ROWS.match(name) else 1, *lay.intermediate, config.intermediate_size)
    if _ROWS_BY_KV_HEAD.match(name) and config.mla is None:
        heads, (a, b), dim = config.num_key_value_heads, lay.kv_heads, 0
    elif _ROWS_BY_Q_HEAD.match(name) or _COLS_BY_Q_HEAD.match(name):
        heads, (a, b) = config.num_attention_heads, lay.q_heads
        dim = 0 if _ROWS_BY_Q_HEAD.match(name) else 1
    else:
        return None
    per = local[dim] // (b - a)  # rows (or columns) per head
    return (dim, a * per, b * per, heads * per)


def shard_targets(targets: dict[str, Target], lay: RankLayout, config: Any
                  ) -> dict[str, Target]:
    """`targets` (the weight map of the rank's model) with each sharded tensor's `part` and
    full checkpoint `shape`."""
    out = {}
    for name, t in targets.items():
        part = _part(name, t.shape, lay, config)
        if part is None:
            out[name] = t
            continue
        dim, start, stop, full_size = part
        if stop - start != t.shape[dim]:
            raise ValueError(f"tensor parallelism: {name}'s rank {lay.rank} part "
                             f"[{start}, {stop}) does not fill its shape {list(t.shape)}")
        full = list(t.shape)
        full[dim] = full_size
        out[name] = replace(t, shape=tuple(full), part=(dim, start, stop))
    return out
