"""Bounded KV caches for full-attention layers: which tokens a sequence keeps, and when.

A bounded sequence keeps at most about `budget` tokens of KV, whatever its length. Its KV is
*compacted*: the kept tokens sit in the sequence's first KV slots, in their original order,
while token positions go on at their true values (keys are stored after RoPE, so a kept key
stays valid wherever it is stored). The request counts the tokens it dropped; its KV length is
its computed tokens less those.

This is **lossy**: dropped tokens are gone for every later token. It is opt-in (engine
arguments or per request) and never on by default.

Policies (`POLICIES`):

- ``streaming_llm`` (Xiao et al., "Efficient Streaming Language Models with Attention Sinks"):
  the first `sink_tokens` tokens plus the most recent ones; the same tokens in every layer and
  head.
- ``snapkv`` (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"): once,
  right after the prompt, each layer and KV head keeps the prompt tokens its last
  `observation_window` queries attended to most (attention weights summed over those queries and
  over the query heads of the KV head, smoothed by an average pool of `SNAPKV_POOL` tokens), plus
  the observation window itself. A layer's heads then hold different tokens in the same slot (the
  pool is [block, slot, head, dim]; attention is per head, so nothing mixes). The scores come
  from the prompt's last prefill chunk (the torch backend computes them for such sequences
  only); a chunk shorter than the window observes the queries it has. Past the prompt the
  sequence is bounded like ``streaming_llm`` over its slots (the first `sink_tokens` slots and the
  most recent ones), since SnapKV itself selects only once.
- ``h2o`` (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference"): each
  layer and KV head accumulates, per kept token, the attention weights every query gave it
  (prompt and generated tokens; summed over the query heads of the KV head), and keeps the
  `budget // 2` heaviest of its older tokens plus the most recent `budget - budget // 2`. The
  accumulated weights of the kept tokens move with them.

When compaction happens (`needs_compaction`): only once the whole prompt is computed (a prompt
is always prefilled with full attention, chunked or not), and then whenever the KV length
reaches `budget + block_size`; it is cut back to `budget` (SnapKV: also right after a prompt
longer than the budget). So compaction runs once per block of
generated tokens, not per token, and the KV a step attends to never exceeds
`budget + block_size` tokens.

Prefix caching: a ``streaming_llm`` request reads the prefix cache like any other; ``snapkv`` and
``h2o`` ones do not (their selection needs the attention weights of every prompt query, which a
cached block does not hold; `Request.skip_reading_prefix_cache`). All insert their full
blocks while they still hold exact KV (its prompt, and anything computed before its first
compaction, was computed with full attention). Its first compaction moves it onto fresh
private blocks and stops its insertions: a pruned block never enters the prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.utils import features as F

POLICIES = ("streaming_llm", "snapkv", "h2o")
ATTENTION_POLICIES = ("snapkv", "h2o")  # select by attention weights: the torch backend only
SNAPKV_POOL = 7  # SnapKV's pooling kernel: a kept token brings its neighbours' votes


@dataclass(frozen=True)
class BoundedKVConfig:
    """What a caller asks for. `budget`: tokens kept (a whole number >= 1), or a fraction of
    the context (in (0, 1), times max_model_len)."""

    policy: str
    budget: float
    sink_tokens: int = 4
    observation_window: int = 32  # SnapKV: the prompt's last queries that vote


@dataclass(frozen=True)
class BoundedKV:
    """A checked policy with its budget resolved to tokens."""

    policy: str
    budget: int
    sink_tokens: int
    observation_window: int = 32

    # -- the policy's hooks (the engine's side: kvserve.engine.bounded_kv.BoundedCaches) ------
    @property
    def selects_by_attention(self) -> bool:
        """Whether the kept tokens are chosen by attention weights (SnapKV, H2O): the backend
        must return them, and the prompt is never read from the prefix cache."""
        return self.policy in ATTENTION_POLICIES

    def observe_rows(self, prompt_len: int, start: int, end: int) -> tuple[int, int] | None:
        """The rows of a chunk of positions [start, end) whose attention weights this policy
        selects by, as (first row, count), or None: every row for H2O; for SnapKV the
        prompt's last `observation_window` positions in this chunk."""
        n = end - start
        if self.policy == "h2o":  # every query votes
            return (0, n)
        if self.policy != "snapkv" or n <= 1:
            return None
        first = max(start, prompt_len - self.observation_window)
        if min(end, prompt_len) > first:
            return (first - start, min(end, prompt_len) - first)
        return None

    def select(self, kv_len: int, prompt_done: bool, votes: torch.Tensor | None,
               block_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Whether a sequence holding `kv_len` tokens of KV (and `votes`, [layers, kv_heads,
        kv_len] or None) is cut back now: the kept KV indices (None: not now) and the votes it
        keeps meanwhile (SnapKV's are used once, right after the prompt, and dropped)."""
        due = needs_compaction(kv_len, prompt_done, self, block_size)
        if self.policy == "snapkv" and votes is not None and prompt_done:
            if kv_len > self.budget:
                return snapkv_keep(votes, self), None  # once, right after the prompt
            return (streaming_keep(kv_len, self) if due else None), None
        if not due:
            return None, votes
        if self.policy == "h2o":
            return h2o_keep(votes, self), votes
        return streaming_keep(kv_len, self), votes

    def most_blocks(self, prompt_len: int, total: int, block_size: int) -> int:
        """The most blocks a bounded sequence of `total` tokens holds at once: its prompt, or
        the compaction point, plus the budget's fresh blocks while it compacts."""
        grown = peak_tokens(prompt_len, total, self, block_size)
        compacting = -(-self.budget // block_size) if total >= self.budget else 0
        return -(-grown // block_size) + compacting

    def moved_votes(self, votes: torch.Tensor | None, keep: torch.Tensor
                    ) -> torch.Tensor | None:
        """The votes a sequence keeps once its KV is cut back to `keep`: H2O's accumulated
        weights move with their tokens."""
        return votes.gather(-1, keep) if self.policy == "h2o" else votes


def resolve_bounded_kv(config: BoundedKVConfig, max_model_len: int,
                       layer_windows: tuple[int | None, ...] = ()) -> BoundedKV:
    """Check a request for a bounded cache against the model and the context; ValueError that
    says why when it cannot be honoured."""
    if config.policy not in POLICIES:
        raise ValueError(f"bounded KV policy must be one of {', '.join(POLICIES)}, "
                         f"got {config.policy!r}")
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    if windowed:
        F.refuse(F.BOUNDED, F.SLIDING_WINDOW, windowed=windowed[:8])
    budget = config.budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"bounded KV budget must be a number of tokens or a fraction of the "
                         f"context, got {budget!r}")
    if 0.0 < budget < 1.0:
        tokens = int(budget * max_model_len)  # a fraction of the context
    elif budget >= 1 and float(budget).is_integer():
        tokens = int(budget)
    else:
        raise ValueError(f"bounded KV budget must be a whole number of tokens (>= 1) or a "
                         f"fraction of the context in (0, 1), got {budget!r}")
    if tokens < 1:
        raise ValueError(f"bounded KV budget must be at least one token, got {budget!r}")
    if tokens > max_model_len:
        raise ValueError(f"bounded KV budget of {tokens} tokens is larger than the context "
                         f"(max_model_len={max_model_len}): nothing would ever be dropped")
    sinks = config.sink_tokens
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sink_tokens must be a non-negative integer, got {sinks!r}")
    if tokens <= sinks:
        raise ValueError(f"bounded KV budget of {tokens} tokens must be larger than its "
                         f"{sinks} sink tokens, or no recent token could be kept")
    window = config.observation_window
    if config.policy == "snapkv":
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"observation_window must be a positive integer, got {window!r}")
        if tokens <= window:
            raise ValueError(f"bounded KV budget of {tokens} tokens must be larger than SnapKV's "
                             f"observation window of {window} tokens (the window is always kept)")
    return BoundedKV(config.policy, tokens, sinks, window)


def compaction_point(bound: BoundedKV, block_size: int) -> int:
    """The KV length at which a sequence past its prompt is cut back to its budget."""
    return bound.budget + block_size


def needs_compaction(kv_len: int, prompt_done: bool, bound: BoundedKV, block_size: int) -> bool:
    """Whether a sequence with `kv_len` tokens of KV is cut back to its budget now."""
    return prompt_done and kv_len >= compaction_point(bound, block_size)


def peak_tokens(prompt_len: int, total: int, bound: BoundedKV, block_size: int) -> int:
    """The most tokens of KV a bounded sequence of `total` tokens holds at once before a
    compaction: its prompt, or the compaction point (never more than it has)."""
    return min(total, max(prompt_len, compaction_point(bound, block_size)))


def streaming_keep(kv_len: int, bound: BoundedKV) -> torch.Tensor:
    """StreamingLLM's kept KV indices ([budget] int64, increasing): the sinks, then the most
    recent budget - sinks."""
    recent = bound.budget - bound.sink_tokens
    return torch.cat([torch.arange(bound.sink_tokens), torch.arange(kv_len - recent, kv_len)])


def snapkv_votes(attn: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """SnapKV's raw votes from one layer's attention weights of some observation queries
    ([heads, queries, keys], softmaxed): summed over the queries and over the query heads that
    share a KV head -> [num_kv_heads, keys]. Votes of the same window computed in several
    chunks add up (padded with zeros to the longest)."""
    heads, _, keys = attn.shape
    return attn.float().sum(1).view(num_kv_heads, heads // num_kv_heads, keys).sum(1)


def add_votes(total: torch.Tensor | None, votes: list[torch.Tensor]) -> torch.Tensor:
    """A step's votes (one [kv_heads, keys] tensor per layer) stacked once into [layers,
    kv_heads, keys] and added to the running `total` (the same shape, perhaps fewer keys: the
    shorter is padded with zeros, the keys it did not see). The sum is made **in place** in the
    longer of the two (both are the caller's to give up: the backend's fresh votes, the
    request's own total), since H2O adds a step's votes on every layer at every decode step and
    a copy per layer and step would cost more than the sum."""
    new = torch.stack(votes)
    if total is None:
        return new
    long, short = (new, total) if new.shape[-1] >= total.shape[-1] else (total, new)
    long[..., :short.shape[-1]] += short
    return long


def h2o_keep(scores: torch.Tensor, bound: BoundedKV) -> torch.Tensor:
    """H2O's kept KV indices per layer and head ([layers, kv_heads, budget], increasing) from
    accumulated attention [layers, kv_heads, kv_len]: the heaviest budget // 2 older tokens,
    then the most recent budget - budget // 2."""
    layers, heads, kv_len = scores.shape
    heavy = bound.budget // 2
    recent = bound.budget - heavy
    top = scores[..., :kv_len - recent].topk(heavy, dim=-1, sorted=False).indices
    tail = torch.arange(kv_len - recent, kv_len).expand(layers, heads, recent)
    return torch.cat([top.sort(-1).values, tail], dim=-1)


def snapkv_keep(votes: torch.Tensor, bound: BoundedKV) -> torch.Tensor:
    """The kept KV indices per layer and head ([layers, kv_heads, budget], increasing) from
    raw votes [layers, kv_heads, kv_len]: average-pooled along the keys (`SNAPKV_POOL`), the
    top budget - window tokens before the observation window, then the window."""
    layers, heads, kv_len = votes.shape
    scores = torch.nn.functional.avg_pool1d(votes.reshape(layers * heads, 1, kv_len),
                                            SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2,
                                            count_include_pad=False).view(layers, heads, kv_len)
    window = min(bound.observation_window, kv_len)
    prefix = kv_len - window
    top = scores[..., :prefix].topk(bound.budget - window, dim=-1, sorted=False).indices
    recent = torch.arange(prefix, kv_len).expand(layers, heads, window)
    return torch.cat([top.sort(-1).values, recent], dim=-1)
