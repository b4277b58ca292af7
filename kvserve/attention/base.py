"""The attention-backend interface: the only place where CPU and GPU code differ.

The runner describes one step as flat tensors (`AttentionMetadata`): which cache slot each new
token's K/V goes to, and, per sequence, its block table and length. The model never sees blocks,
pools or policies: it is handed an `AttentionFn` that maps (layer, q, k, v) to the attention
output for this step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from kvserve.kv.spec import SlidingWindowSpec
from kvserve.kv.tensors import KVTensorPool

# (layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer_idx, hidden [T, hidden]) after that layer -> None, or (the rows the later layers
# run, the AttentionFn for those rows): CausalLM.forward's `between`
RowCut = Callable[[int, torch.Tensor], "tuple[torch.Tensor, AttentionFn] | None"]


@dataclass
class SequenceSlice:
    """One sequence's part of a step: its new tokens are rows [start, start + query_len)."""

    start: int
    query_len: int
    seq_len: int  # KV length after this step: cached context + query_len
    block_table: list[int]
    # SnapKV (kvserve.kv.bounded): the rows [observe_start, observe_start + observe_len) of this
    # slice are observation queries: the backend keeps their summed attention weights under
    # `key` (the request id). observe_len 0 for every other sequence.
    observe_start: int = 0
    observe_len: int = 0
    key: str | None = None
    # Document reuse (kvserve/blend/): the rows' positions when they are not the last
    # query_len of seq_len (a blended request computes runs of positions; each row sees every
    # stored position up to its own). None: the usual contiguous rows.
    positions: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step description of a flat batch, built once and read by every layer.

    Sequences with more than one new token (prefill chunks) come first, then single-token
    decodes, so that decodes form one contiguous tail that a backend can batch.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    prefills: list[SequenceSlice]
    decodes: list[SequenceSlice]
    num_prefill_tokens: int
    # Per-group tables (a hybrid layout, KVTensorPool.page_groups): group g's own metadata
    # (its slots and block tables; self is groups[0]); layer l reads groups[pool.layer_group[l]].
    groups: list[AttentionMetadata] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)


class BoundAttention:
    """One step's attention: `__call__(layer, q, k, v)` is the AttentionFn the model calls;
    `kernel_args` hands out the backend's kernel arguments for a layer instead (the CPU's
    one-call decode, kvserve/layers/fast_decode.py)."""

    def __init__(self, backend: AttentionBackend, metas: list[AttentionMetadata],
                 states: list[object]) -> None:
        self.backend = backend
        self.metas = metas
        self.states = states
        self._group = backend.pool.layer_group if len(metas) > 1 else None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        g = self._group[layer_idx] if self._group is not None else 0
        return self.backend.forward(layer_idx, q, k, v, self.metas[g], self.states[g])

    def kernel_args(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor) -> tuple[int, object] | None:
        g = self._group[layer_idx] if self._group is not None else 0
        return self.backend.kernel_args(layer_idx, q, k, v, out, self.metas[g], self.states[g])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_block_tables(seqs: list[SequenceSlice], block_size: int) -> list[list[int]]:
    """Each sequence's block table cut to the blocks its `seq_len` tokens use, zero-padded to
    the widest: the rectangular table the decode kernels take. Released entries (NULL_BLOCK,
    before a sliding window) become 0 too, so every id is valid; the kernels never read them,
    nor the padding."""
    used = [ceil_div(s.seq_len, block_size) for s in seqs]
    width = max(used, default=0)
    return [[max(b, 0) for b in s.block_table[:n]] + [0] * (width - n)
            for s, n in zip(seqs, used)]


class AttentionBackend(ABC):
    """Computes attention over the KV tensor pool's per-layer (K, V) tensors; owns no storage."""

    # Whether the backend computes the attention weights of a sequence's observation queries
    # (SequenceSlice.observe_len: SnapKV and H2O select the tokens they keep by them). SDPA and
    # the fused kernels return no weights, so a backend says it does, and the engine refuses
    # those policies on one that does not.
    observes_attention: bool = False

    def __init__(self, pool: KVTensorPool, scale: float) -> None:
        self.pool = pool
        # The votes of the step's observation queries (a backend that observes fills it):
        # request id -> one [kv_heads, seq_len] tensor per layer, taken by the engine after the
        # step (engine/bounded_kv.py). Always empty in a backend that does not observe.
        self.observed: dict[str, list[torch.Tensor]] = {}
        self.kv_caches = pool.layers  # per layer: (k, v), each [num_blocks, block_size, Hkv, D]
        self.block_size = pool.block_size
        self.scale = scale
        # Per layer: None (full attention) or W, the layer attends to the last W positions, its
        # own included (key k is visible to query q iff q - W < k <= q, transformers' rule).
        self.windows: list[int | None] = [
            s.window if isinstance(s, SlidingWindowSpec) else None
            for s in pool.spec.layer_specs()]

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> object:
        """Build whatever per-step state the backend needs (gather indices, masks) once."""

    @abstractmethod
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, state: object) -> torch.Tensor:
        """Write k/v into their slots, then attend q over each sequence's cached KV."""

    def bind(self, meta: AttentionMetadata) -> BoundAttention:
        """The attention function the model calls for this step. Per-group tables (a hybrid
        layout): each group's step state is prepared once, and each layer attends with its
        group's (same backend code: a group is an ordinary paged cache)."""
        metas = meta.groups if meta.groups is not None else [meta]
        return BoundAttention(self, metas, [self.prepare(m) for m in metas])

    def kernel_args(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, meta: AttentionMetadata, state: object
                    ) -> tuple[int, object] | None:
        """(the C entry point, its prepared argument struct) of the paged decode kernel for
        this layer's decodes (store k/v, attend q, write out), for a caller that runs the
        kernel itself; None where this backend or step has none (the caller then calls the
        backend)."""
        return None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks in every layer (copy-on-write); a backend with a faster kernel for
        its device overrides this."""
        self.pool.copy_blocks(src, dst)
