"""Drafting with a second, smaller model (speculative_config method "draft_model"): the draft
runs greedily over each request's own tokens and proposes its next k tokens.

Why greedy: the verification's rejection sampler (worker/spec_verify.py) is exact for a
deterministic draft (a draft distribution that is one token with probability 1), so a greedy
draft keeps every output, sampled or not, distributed as without speculation; a sampled draft
would need its probabilities carried to the verification.

Why a dense KV cache of its own per request, and not the engine's pool: the draft's KV has
its own shape (its layers, heads and dtype), is never shared or evicted, and lives only as
long as its request; a few growing tensors per layer are all it needs. Each proposal keeps the
longest common prefix of what the cache holds and the request's tokens (the drafts the
target rejected last step fall away), computes the rest as one prefill, then decodes k - 1
tokens one at a time (the k-th is returned, not computed into the cache). Its attention is
plain causal SDPA over the dense cache (grouped-query heads, sliding windows as a mask,
Gemma 2's soft-capping); the model's one-call decode step only serves the engine's paged
attention, so the draft runs its layers one by one (`CausalLM.forward` falls back by itself).

Memory: per running request, layers x 2 x kv_heads x head_dim values per token in the draft's
dtype (SmolLM2-135M in float32: 46 KB a token), freed when the request finishes
(`release`, called by the scheduler's finish) and never shared between requests. A preempted
request keeps it (its tokens stay, so it is still valid when the request runs again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.attention.softcap import sdpa
from kvserve.kv.prefix_index import common_prefix
from kvserve.models.config import ModelConfig


@dataclass
class DenseKV:
    """One request's draft KV: per layer keys and values [kv_heads, capacity, head_dim] whose
    first len(tokens) positions hold `tokens`' K/V."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device,
              capacity: int) -> "DenseKV":
        shape = (config.num_key_value_heads, capacity, config.head_dim)
        n = config.num_hidden_layers
        return cls([torch.empty(shape, dtype=dtype, device=device) for _ in range(n)],
                   [torch.empty(shape, dtype=dtype, device=device) for _ in range(n)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, length: int) -> None:
        """Room for `length` positions (doubling: a request's decode steps copy rarely)."""
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        held = len(self.tokens)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_empty((old.shape[0], size, old.shape[2]))
                new[:, :held] = old[:, :held]
                tensors[i] = new

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class DraftStats:
    """What the drafter computed: forwards run and tokens fed through the draft model."""

    forwards: int = 0
    tokens: int = 0


class DraftModelDrafter:
    """The Drafter of method "draft_model" (spec/speculator.py's `Drafter` signature)."""

    _MIN_CAPACITY = 256  # positions a request's first cache holds (then doubled as needed)

    def __init__(self, model: Any, config: ModelConfig, max_len: int) -> None:
        """`model`: the loaded draft (a CausalLM); `config`: its ModelConfig; `max_len`: the
        longest sequence it drafts for (a request beyond it drafts nothing)."""
        check_draft_architecture(config)
        self.model = model
        self.config = config
        self.max_len = max_len
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.caches: dict[str, DenseKV] = {}
        self.stats = DraftStats()

    def __call__(self, request: Any, k: int) -> list[int]:
        """Up to k greedy draft tokens after `request.token_ids`."""
        tokens = request.token_ids
        if k <= 0 or not tokens or len(tokens) + k > self.max_len:
            return []
        cache = self.caches.get(request.request_id)
        if cache is None:
            cache = self.caches[request.request_id] = DenseKV.empty(
                self.config, self.dtype, self.device,
                min(self.max_len, max(self._MIN_CAPACITY, len(tokens) + k)))
        # keep what still agrees, and at least the last token to compute (its logits)
        keep = min(common_prefix(cache.tokens, tokens), len(tokens) - 1)
        del cache.tokens[keep:]
        with torch.inference_mode():
            draft = [self._forward(cache, tokens[keep:])]
            while len(draft) < k:
                draft.append(self._forward(cache, draft[-1:]))
        return draft

    def release(self, request: Any) -> None:
        """Drop a finished request's cache."""
        self.caches.pop(request.request_id, None)

    def _forward(self, cache: DenseKV, new: list[int]) -> int:
        """Compute `new` after the cache's tokens into it; the argmax of the last row."""
        start, n = len(cache.tokens), len(new)
        end = start + n
        cache.reserve(end)
        ids = torch.tensor(new, dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, dtype=torch.long, device=self.device)
        masks = {w: _mask(start, n, w, self.device) for w in set(self.config.windows)}
        windows, scale = self.config.windows, self.config.attention_scale
        softcap = self.config.attn_logit_softcapping

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            keys, values = cache.keys[layer], cache.values[layer]
            keys[:, start:end] = k.transpose(0, 1)
            values[:, start:end] = v.transpose(0, 1)
            mask, causal = masks[windows[layer]]
            # (4-D: CPU SDPA's fused kernels; 3-D inputs took its math path, 20x slower)
            out = sdpa(q.transpose(0, 1)[None], keys[None, :, :end], values[None, :, :end],
                       attn_mask=mask, is_causal=causal, scale=scale, softcap=softcap)
            return out[0].transpose(0, 1)

        hidden = self.model(ids, positions, attend)
        cache.tokens.extend(new)
        self.stats.forwards += 1
        self.stats.tokens += n
        logits = self.model.compute_logits(hidden[-1:])
        return int(logits[0].argmax())

    def cached_bytes(self) -> int:
        """The draft KV the running requests hold."""
        return sum(c.nbytes() for c in self.caches.values())


def check_draft_architecture(config: ModelConfig) -> None:
    """Refuse a draft whose attention the dense draft cache does not compute: MLA's latent
    KV (DeepSeek) attends through its own projections, not per-head K/V."""
    if config.mla is not None:
        raise ValueError(f"speculative_config draft model ({config.architecture}) uses MLA "
                         "(a latent KV cache), which the draft's dense attention does not "
                         "compute; use a draft with per-head K/V (Llama, Qwen, Mistral, ...)")


def check_same_vocabulary(draft: ModelConfig, target: ModelConfig,
                          draft_vocab: dict[str, int] | None,
                          target_vocab: dict[str, int] | None) -> None:
    """vLLM's rule: the draft must share the target's tokenizer (its token ids are the
    target's). The models' vocabulary sizes, and where both have a tokenizer, the token ->
    id maps themselves."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config draft model's vocabulary ({draft.vocab_size} "
                         f"tokens) differs from the target's ({target.vocab_size}): the draft "
                         "must use the target's tokenizer")
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise ValueError("speculative_config draft model's tokenizer differs from the "
                         f"target's (e.g. {differ}): the draft must use the target's tokenizer")


def _mask(start: int, n: int, window: int | None, device: torch.device
          ) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for n queries at positions start.. over keys 0..start + n - 1:
    query i sees keys j with start + i - window < j <= start + i. The mask is [n, start + n]
    bool (True = attend) or None: one query without a window sees everything, and a first
    prefill without a window is SDPA's own causal mask (which its fused kernel skips by)."""
    if window is None or start + n <= window:
        if n == 1:
            return None, False
        if start == 0:
            return None, True
    q = torch.arange(start, start + n, device=device).unsqueeze(1)
    j = torch.arange(start + n, device=device).unsqueeze(0)
    visible = j <= q
    if window is not None:
        visible &= j > q - window
    return visible, False
