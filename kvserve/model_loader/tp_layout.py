"""Which part of the model each tensor-parallel rank holds.

Attention is split by KV head (each rank's query heads are those of its KV heads, so every
rank runs ordinary grouped-query attention over its own heads); with fewer KV heads than ranks
each KV head is replicated on `tp / num_kv_heads` ranks, which split its query heads. Splits
need not be even: SmolLM2-135M's 3 KV heads over 2 ranks are 2 + 1 (vLLM refuses such a model;
here the ranks simply differ in size, and the block count is the largest rank's). The MLP's
intermediate columns and the vocabulary are split into near-equal contiguous ranges.

Why plain data with no torch: the planner prints per-rank memory from the same ranges the
workers allocate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are split into `parts` contiguous ranges
    whose sizes differ by at most one (the larger ones first)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class RankLayout:
    """One rank's ranges (global indices, [start, stop))."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    moe_intermediate: tuple[int, int] | None = None

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def check_tp(config: Any, tp: int) -> None:
    """Refuse a tensor-parallel size this model cannot be split into (ValueError naming why)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    h, kv = config.num_attention_heads, config.num_key_value_heads
    if config.mla is None:
        if kv < tp and tp % kv:
            raise ValueError(f"tensor_parallel_size {tp} cannot split {kv} KV heads: with "
                             "fewer KV heads than ranks it must be a multiple of them")
        if kv < tp and (h // kv) < tp // kv:
            raise ValueError(f"tensor_parallel_size {tp}: each of the {kv} KV heads has "
                             f"{h // kv} query heads, fewer than the {tp // kv} ranks "
                             "that would share it")
    elif h < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the {h} attention heads")
    if config.intermediate_size < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the intermediate size")
    if not config.qk_norm_per_head and config.qk_norm:
        raise ValueError(f"{config.architecture} norms q and k over the whole projection, "
                         "across every head: tensor parallelism does not split it")
    if getattr(config, "rotary_dim", None) not in (None, config.head_dim):
        raise ValueError(f"{config.architecture}'s partial RoPE permutes its fused qkv rows: "
                         "tensor parallelism does not split it")


def rank_layout(config: Any, rank: int, tp: int) -> RankLayout:
    """Rank `rank`'s ranges of a model with `config` (a ModelConfig) split `tp` ways."""
    check_tp(config, tp)
    h, kv = config.num_attention_heads, config.num_key_value_heads
    if config.mla is not None:  # MLA: query heads split; the latent is one "KV head" per rank
        q, kvr = split(h, tp, rank), (0, 1)
    elif kv >= tp:
        kvr = split(kv, tp, rank)
        group = h // kv
        q = (kvr[0] * group, kvr[1] * group)
    else:  # each KV head on tp / kv ranks, which split its query heads
        share = tp // kv
        head = rank // share
        group = h // kv
        a, b = split(group, share, rank % share)
        kvr, q = (head, head + 1), (head * group + a, head * group + b)
    moe = getattr(config, "moe", None)
    return RankLayout(rank, tp, q, kvr, split(config.intermediate_size, tp, rank),
                      split(config.vocab_size, tp, rank),
                      split(moe.moe_intermediate_size, tp, rank) if moe is not None else None)


def rank_config(config: Any, layout: RankLayout) -> Any:
    """The ModelConfig of one rank's shard: its head counts, MLP width and vocabulary rows
    (the model code runs it as an ordinary, smaller model)."""
    fields = dict(num_attention_heads=layout.num_heads,
                  num_key_value_heads=layout.num_kv_heads if config.mla is None
                  else config.num_key_value_heads,
                  intermediate_size=layout.intermediate[1] - layout.intermediate[0],
                  vocab_size=layout.vocab[1] - layout.vocab[0])
    if layout.moe_intermediate is not None:
        a, b = layout.moe_intermediate
        fields["moe"] = replace(config.moe, moe_intermediate_size=b - a)
    return replace(config, **fields)

