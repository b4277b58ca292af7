"""Preemption by swap: a preempted request's KV goes to host swap space and comes back on resume.

The seeds name two ways to preempt a request when the pool runs out: free its blocks and
recompute its tokens later, or copy its KV out and back (vLLM v0's `preemption_mode`, with
`swap_space` GiB of host memory). Recompute costs a prefill of every token again (0.1-0.3 s per
1k tokens on a CPU); a swap costs moving the bytes twice, which is far less for long requests.

How a swap goes, all of it as data in the step plans (kv/plan.py), like the tiers:

* out: when the scheduler preempts a request, `swap_out` decides (the mode, the room left, the
  measured speeds) and names the request's blocks in the plan (`SwapOut`). The worker reads them
  before anything in that step can reuse them; the engine hands the KV back (`fill`). The
  request's leading blocks that another holder keeps (a shared prefix, a pin) stay where they
  are and are not copied; every other block is, cached or not, because a freed cached block is
  idle, and an idle block is what the very memory pressure that caused the preemption evicts.
* in: when the request is admitted again, `resume` continues its device match with the swapped
  blocks past it (`SwapMatch`); the manager gives them fresh blocks and puts their KV in the
  plan's loads, and the request goes on from the token it had reached. Blocks the device still
  holds are hits, not loads.
* fallbacks: a swap that does not fit the space, a layout the swap cannot carry (int4's
  per-block state, per-group or windowed tables, a bounded cache), KV that never came back (the
  step failed) or a prefix that was evicted under the swapped blocks: the request recomputes,
  exactly as without swap, and a counter says why.

`auto` swaps a request when moving its bytes out and in is faster than recomputing its tokens:
the copy speed is measured at start-up (engine/swapping.py), the prefill speed is the engine's
own, observed on its prefill steps (`observe_prefill`); until one is seen, auto swaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.kv.plan import SwapOut
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.kv.seq import CachedSeq

PREEMPTION_MODES = ("recompute", "swap", "auto")
GIB = 1024**3
MIN_OBSERVED_TOKENS = 32  # a smaller prefill step is mostly fixed cost, not speed


@dataclass
class SwapSpeeds:
    """What `auto` weighs: one-way copy speed between the pool and host memory (measured at
    start-up), and prefill speed (None until a prefill step was observed: then swap)."""

    copy_bytes_per_s: float
    prefill_tokens_per_s: float | None = None

    def swap_is_faster(self, num_bytes: int, num_tokens: int) -> bool:
        if self.prefill_tokens_per_s is None:
            return True
        return 2 * num_bytes / self.copy_bytes_per_s < num_tokens / self.prefill_tokens_per_s

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` prompt tokens took `seconds` (a moving average:
        the speed at the lengths this engine really prefills, decodes of the step included)."""
        if num_tokens < MIN_OBSERVED_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate


@dataclass
class _Swapped:
    first_block: int  # the leading blocks that stayed on the device (not in `data`)
    num_blocks: int
    num_tokens: int  # computed tokens the swapped KV (with the blocks that stayed) covers
    num_bytes: int
    data: torch.Tensor | None = None  # [layers, parts, blocks * block_size | blocks, ...]


@dataclass
class SwapMatch(PrefixMatch):
    """A device match continued by swapped blocks: the manager allocates `num_loaded_blocks`
    fresh blocks after `nodes` and loads `data` into them; the request has then computed
    `swapped_tokens` (the last block may be partial, so this is not a block multiple)."""

    data: torch.Tensor | None = None
    num_loaded_blocks: int = 0
    swapped_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.swapped_tokens


@dataclass
class SwapStats:
    swapped_out: int = 0  # requests
    swapped_in: int = 0
    resumed_on_device: int = 0  # swapped, but the device still held all of it at resume
    bytes_out: int = 0
    bytes_in: int = 0
    # Preemptions that recomputed though a swap was possible in principle, by reason.
    fallbacks: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def as_dict(self) -> dict[str, int]:
        out = {"swapped_out": self.swapped_out, "swapped_in": self.swapped_in,
               "resumed_on_device": self.resumed_on_device, "bytes_out": self.bytes_out,
               "bytes_in": self.bytes_in}
        out.update({f"fallback_{k}": v for k, v in self.fallbacks.items()})
        return out


class SwapSpace:
    """Host swap space for preempted requests, bounded in bytes (`swap_space` GiB)."""

    def __init__(self, mode: str, capacity_bytes: int, block_bytes: int, block_size: int,
                 speeds: SwapSpeeds | None = None, unsupported: str | None = None) -> None:
        """`block_bytes`: one block of every layer; `unsupported`: why this engine's KV layout
        cannot be swapped (then every preemption recomputes)."""
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.speeds = speeds
        self.unsupported = unsupported
        self.used_bytes = 0
        self._swapped: dict[str, _Swapped] = {}
        self.stats = SwapStats()

    @property
    def enabled(self) -> bool:
        return self.mode != "recompute" and self.unsupported is None and self.capacity_bytes > 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._swapped

    def __len__(self) -> int:
        return len(self._swapped)

    # -- out --------------------------------------------------------------------------------
    def swap_out(self, kv: Any, seq: CachedSeq, bounded: bool = False) -> SwapOut | None:
        """Decide whether preempting `seq` swaps it, and if so reserve its room and return the
        plan's read of its blocks (the caller frees the blocks right after). `kv` is the
        KVCacheManager; `bounded`: the request keeps a bounded cache (its blocks hold a
        compacted KV the swap does not carry)."""
        if not self.enabled or seq.num_computed_tokens == 0:
            return None
        if bounded:
            self.stats.fallback("bounded")
            return None
        table = kv.block_table(seq)
        used = kv.blocks_for_tokens(seq.num_computed_tokens)
        refs = kv.pool.ref_counts
        first = 0
        while first < used and refs[table[first]] > 1:  # held by another: it stays
            first += 1
        n = used - first
        if n == 0:
            return None  # everything it computed stays on the device: a plain preemption
        nbytes = n * self.block_bytes
        tokens = seq.num_computed_tokens - first * self.block_size
        if self.mode == "auto" and self.speeds is not None \
                and not self.speeds.swap_is_faster(nbytes, tokens):
            self.stats.fallback("recompute_cheaper")
            return None
        if self.used_bytes + nbytes > self.capacity_bytes:
            self.stats.fallback("space_full")
            return None
        self.used_bytes += nbytes
        self._swapped[seq.request_id] = _Swapped(first, n, seq.num_computed_tokens, nbytes)
        self.stats.swapped_out += 1
        self.stats.bytes_out += nbytes
        return SwapOut(seq.request_id, tuple(table[first:used]))

    def fill(self, swapped: dict[str, torch.Tensor]) -> None:
        """The KV the worker read for the plan's swap-outs."""
        for request_id, data in swapped.items():
            entry = self._swapped.get(request_id)
            if entry is not None:
                entry.data = data

    # -- in ---------------------------------------------------------------------------------
    def resume(self, seq: CachedSeq, device_match: PrefixMatch) -> PrefixMatch | None:
        """For a swapped request being admitted again: its device match continued by its
        swapped blocks, or None (the entry is dropped and the request recomputes from what the
        device holds). The entry stays until `admitted`, so a refused admission can retry."""
        entry = self._swapped.get(seq.request_id)
        if entry is None:
            return None
        d = len(device_match.nodes)
        if entry.data is None:
            return self._give_up(seq.request_id, "lost")  # the step that read it failed
        if d < entry.first_block:
            return self._give_up(seq.request_id, "prefix_evicted")  # a gap before the swap
        if d * self.block_size >= entry.num_tokens:
            self.stats.resumed_on_device += 1
            self.drop(seq.request_id)  # the device holds all of it: a plain hit
            return None
        skip = d - entry.first_block  # swapped blocks the device holds again: not loaded
        data = entry.data
        if skip:
            per_block = data.shape[2] // entry.num_blocks  # tokens, or 1 for a packed pool
            data = data[:, :, skip * per_block:]
        plain = device_match.without_partial()
        return SwapMatch(plain.nodes, block_size=plain.block_size, data=data,
                         num_loaded_blocks=entry.num_blocks - skip,
                         swapped_tokens=entry.num_tokens)

    def admitted(self, request_id: str, match: PrefixMatch) -> None:
        """The request was admitted with `match` (from `resume`): its space is free again."""
        entry = self._swapped.pop(request_id, None)
        if entry is None:
            return
        self.used_bytes -= entry.num_bytes
        if isinstance(match, SwapMatch):
            self.stats.swapped_in += 1
            self.stats.bytes_in += match.num_loaded_blocks * self.block_bytes

    def _give_up(self, request_id: str, reason: str) -> None:
        self.stats.fallback(reason)
        self.drop(request_id)
        return None

    def drop(self, request_id: str) -> None:
        """Forget a request's swapped KV (it finished, was aborted, or recomputes)."""
        entry = self._swapped.pop(request_id, None)
        if entry is not None:
            self.used_bytes -= entry.num_bytes

    def check_invariants(self, waiting: set[str]) -> None:
        """Only waiting requests have swapped KV, and the space's count is theirs."""
        assert set(self._swapped) <= waiting, "a running or finished request holds swap space"
        assert self.used_bytes == sum(e.num_bytes for e in self._swapped.values())
        assert self.used_bytes <= self.capacity_bytes
