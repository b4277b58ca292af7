"""The manager's questions to the prefix cache (kv/manager.py inherits them): a sequence's block
hashes, the longest prefix the device blocks hold in every group, what the storage tiers add, and
the prefetches that bring chunks up from disk, Redis or a peer. Read-only on the tables and the
pool: what a hit gives a sequence is admission's (kv/manager.py)."""

from __future__ import annotations

from kvserve.kv.group import Group
from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.kv.prefix_index import PrefixIndex, PrefixMatch
from kvserve.kv.seq import CachedSeq, matchable_tokens
from kvserve.kv.tiers.link import Tiers


class PrefixLookup:
    """Needs `block_size`, `prefix_caching`, `groups` and `tiers` (set by the manager)."""

    block_size: int
    prefix_caching: bool
    groups: list[Group]
    tiers: Tiers

    def block_hashes(self, seq: CachedSeq, num_blocks: int) -> list[int]:
        """The sequence's chained block hashes, extended on demand to `num_blocks` full blocks."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else 0
            hashes.extend(chain_hashes(seq.token_ids[: num_blocks * self.block_size],
                                       self.block_size, extra_keys(seq.cache_salt), parent,
                                       start_block=len(hashes)))
        return hashes[:num_blocks]

    def _matchable_hashes(self, seq: CachedSeq) -> list[int]:
        return self.block_hashes(seq, matchable_tokens(seq) // self.block_size)

    def device_match(self, seq: CachedSeq) -> PrefixMatch:
        """The longest prefix of a sequence that device blocks hold (in every group)."""
        limit = matchable_tokens(seq)
        if limit == 0 or not self.prefix_caching:
            return PrefixMatch([], block_size=self.block_size)
        tokens, hashes = seq.token_ids[:limit], self._matchable_hashes(seq)
        extra = extra_keys(seq.cache_salt)
        indexes: list[PrefixIndex] = [g.index for g in self.groups]  # type: ignore[misc]
        if len(indexes) == 1:  # one index can also serve a partial hit (a copy-on-write)
            return indexes[0].match(tokens, hashes, extra)
        # Each group's path, and the deepest depth every group can serve. No partial hit (a
        # copy would be needed in every group at once).
        paths = [index.walk(tokens, hashes, extra) for index in indexes]
        valid = [index.valid_depths(p) for index, p in zip(indexes, paths)]
        depth = max(d for d in range(min(len(p) for p in paths) + 1)
                    if all(v[d] for v in valid))
        return PrefixMatch(paths[0][:depth], block_size=self.block_size,
                           group_nodes=[p[:depth] for p in paths])

    def match(self, seq: CachedSeq) -> PrefixMatch:
        """The longest cached prefix of a sequence that holds no blocks: device blocks, then
        chunks in host memory."""
        match = self.device_match(seq)
        if matchable_tokens(seq) == 0 or not self.prefix_caching:
            return match
        return self.tiers.continue_match(match, self._matchable_hashes(seq))

    def match_after_prefetch(self, seq: CachedSeq) -> PrefixMatch:
        """`match` as the sequence would find it once a prefetch of its chunks on disk or in
        Redis were done, without doing one (read-only: the cache report's explain)."""
        match = self.device_match(seq)
        if matchable_tokens(seq) == 0 or not self.prefix_caching:
            return match
        return self.tiers.match_after_prefetch(match, self._matchable_hashes(seq))

    def hashes_completed_by(self, seq: CachedSeq, num_new_tokens: int) -> list[int]:
        """Hashes of the full blocks that computing `num_new_tokens` more of `seq` completes (the
        scheduler lets a request whose next block is among them wait a step and hit it)."""
        if not self.prefix_caching:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        return self.block_hashes(seq, last)[first:] if last > first else []

    def next_block_hash(self, seq: CachedSeq, match: PrefixMatch) -> int | None:
        """The hash of the first matchable block that `match` does not cover, if any."""
        hashes = self._matchable_hashes(seq) if self.prefix_caching else []
        j = match.num_full_blocks
        return hashes[j] if j < len(hashes) else None

    def start_prefetch(self, seq: CachedSeq, peer: str | None = None) -> None:
        """Begin promoting the sequence's chunks from disk/Redis (and `peer`, the instance
        that computed its prompt) into host memory."""
        if matchable_tokens(seq) and self.prefix_caching:
            self.tiers.start_prefetch(seq.request_id, self._matchable_hashes(seq),
                                      len(self.device_match(seq).nodes), peer)

    def prefetch_pending(self, seq: CachedSeq) -> bool:
        return self.tiers.prefetch_pending(seq.request_id)

    def wait_for_prefetch(self, seconds: float) -> bool:
        """Block up to `seconds` for a pending prefetch (an engine with nothing else to do);
        True if there was one."""
        return self.tiers.wait_for_prefetch(seconds)
