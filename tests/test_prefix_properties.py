"""Prefix caching at the KV-manager level, without a model.

A hypothesis state machine drives `KVCacheManager` through random interleavings of what the
scheduler and the engine do to it (match, admit = lock a shared prefix, compute + insert full
blocks, finish/abort = unlock, preempt and resume, evict, allocation pressure, reset), with prompts
over a tiny alphabet so that prefixes collide often. Next to the manager it keeps its own model:

* which request holds which block (so a block held by a live request is never handed to anyone
  else, freed or evicted while held);
* what every KV slot contains: a slot holds the identity of the token prefix that was computed
  into it. A request must find, at every computed position, exactly its own prefix's identity: a
  prefix-cache hit that served wrong or overwritten KV, a copy-on-write that copied the wrong
  block, or a block reused while still held shows up as a wrong slot.

With a sliding window (issue 15 part 3; the machine draws one, or none), the manager releases
every block wholly before a request's window: the model then checks only the positions a request
can still read, that they sit in blocks it holds, that an idle interior block of the index can be
evicted (it turns hollow) and that a hit never serves a hollow block a query could read.

Hybrid layouts (issue 15 part 2; the machine draws one): a full group and two windowed groups
over one pool, each with its own table and index. The model then tracks every group's slots
(block ids never repeat across groups), checks each group's readable positions, each group's part
of a hit, and that a hit is valid in every group at once.

Cache control (issue 33) runs in the same machine: tenant quotas (the salts are the tenants),
pins (held like a request's blocks; unpinned at random), retention priorities with TTLs on a
clock the machine advances, and audit drops of random nodes. None of them may change what a
request reads, leak a block, or leave an idle block the pool counts as available unevictable.

Then unit tests for the eviction policies (lru / lfu / priority), leaf-first eviction, and the
cost of eviction with many idle leaves.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import kvserve.kv.prefix_index as prefix_index_module
from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.hashing import chain_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import PinLimitError
from kvserve.kv.prefix_index import PrefixIndex
from kvserve.kv.retention import Retention, RetentionRange, retain_sequence
from kvserve.request import Request
from kvserve.sampling import SamplingParams

ALPHABET = 3  # token ids 0..2: random prompts share prefixes all the time
MAX_LIVE = 3
SALTS = (None, None, None, "tenant-a", "tenant-b")
PARAMS = SamplingParams(temperature=0.0, max_tokens=64)


def _request(rid: str, tokens: list[int], salt: str | None = None,
             priority: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=PARAMS,
                   max_tokens=64, cache_salt=salt, priority=priority)


def _identity(salt: str | None, tokens: list[int], pos: int) -> tuple:
    """What a KV slot at `pos` holds after computing `tokens[: pos + 1]` (KV depends on the
    whole prefix, and a salt never mixes with another)."""
    return (salt, tuple(tokens[: pos + 1]))


def _tree_nodes(index: PrefixIndex):
    for root in index._roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def check_index_evictable(kv: KVCacheManager) -> None:
    """What the pool counts as available must really be obtainable: every idle cached block can
    be evicted, leaves first. So a held node's parent is held (or a root), and every idle leaf
    has a live heap entry. With a window, any idle node has one (it turns hollow when evicted
    with children), and a hollow node always leads to another node. Every group's index."""
    if not kv.prefix_caching:
        return
    idle = sum(_idle_evictable(g.index, kv.pool.ref_counts) for g in kv.groups)
    assert idle == kv.pool.num_cached_idle


def _idle_evictable(index: PrefixIndex, refs: list[int]) -> int:
    live_entries = {(id(node), version) for *_, version, node in index._heap}
    idle = 0
    for node in _tree_nodes(index):
        parent = node.parent
        if node.block == NULL_BLOCK:
            assert index.window is not None and node.children, "a stray hollow node"
            continue
        if index.window is not None:
            if refs[node.block] == 0:
                idle += 1
                assert (id(node), node.version) in live_entries, \
                    f"idle block {node.block} has no heap entry: it can never be evicted"
            continue
        if refs[node.block] > 0 and parent is not None and parent.block >= 0:
            assert refs[parent.block] > 0, (
                f"block {parent.block} is idle (counted as available) but has a held child "
                f"{node.block}: it cannot be evicted")
        if refs[node.block] == 0:
            idle += 1
            if not node.children:
                assert (id(node), node.version) in live_entries, \
                    f"idle leaf {node.block} has no heap entry: it can never be evicted"
    return idle


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 3, 4]),
                policy=st.sampled_from(["lru", "lfu", "priority"]),
                window=st.sampled_from([None, None, 1, 2, 3, 5, 8]), hybrid=st.booleans(),
                quota=st.sampled_from([None, None, 0.3]))
    def setup(self, num_blocks, block_size, policy, window, hybrid, quota):
        if hybrid and window is not None:  # a full group and two windowed ones
            self.windows = (None, window, window)
            self.kv = KVCacheManager(num_blocks * 2, block_size, True, policy,
                                     group_windows=self.windows)
        else:
            self.windows = (window,)
            self.kv = KVCacheManager(num_blocks, block_size, True, policy, window=window)
        if quota is not None:
            self.kv.set_tenant_quota(quota)
        self.now = 0.0
        for g in self.kv.groups:
            g.index.clock = lambda: self.now
        self.pins: list[str] = []
        self.bs = block_size
        self.groups = range(self.kv.num_groups)
        self.live: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.history: list[tuple[list[int], str | None]] = []  # computed prefixes, for reuse
        self.tables: dict[str, list[list[int]]] = {}  # our copy of every live table, per group
        self.slots: dict[tuple[int, int], tuple] = {}  # (block, offset) -> identity
        self.next_id = 0
        self.queries = 0
        self.hits = 0

    # -- helpers ----------------------------------------------------------------------------
    def _held_by_others(self, rid: str) -> set[int]:
        return {b for r, ts in self.tables.items() if r != rid for t in ts for b in t
                if b != NULL_BLOCK}

    def _first_block(self, num_tokens: int, g: int = 0) -> int:
        """The block of the first key the query at position `num_tokens` sees in group g:
        transformers' rule (key k visible to query q iff q - W < k <= q), written here
        rather than read from the manager under test."""
        w = self.windows[g]
        return 0 if w is None else max(0, num_tokens - w + 1) // self.bs

    def _readable(self, req: Request, g: int = 0) -> range:
        """The computed positions a request can still read in a group: from its window's
        first block."""
        first = self._first_block(req.num_computed_tokens, g) * self.bs
        return range(first, req.num_computed_tokens)

    def _slot(self, req: Request, pos: int, g: int = 0) -> tuple[int, int]:
        table = self.kv.groups[g].tables[req.request_id]
        return table[pos // self.bs], pos % self.bs

    def _copy(self, src: list[int], dst: list[int]) -> None:
        """The copy-on-write the runner performs: sources are cached or held, destinations
        were just given to the admitted request and to nobody else."""
        for s, d in zip(src, dst):
            # The manager lets go of a source when it hands out the plan; the runner copies
            # before anything can allocate again, so it must still be cached (never free).
            assert self.kv.pool.ref_counts[s] > 0 or self.kv.pool.cached[s], \
                "copy source was freed before its copy"
            assert self.kv.pool.ref_counts[d] == 1, "copy destination is shared"
            for off in range(self.bs):
                if (s, off) in self.slots:
                    self.slots[(d, off)] = self.slots[(s, off)]
                else:
                    self.slots.pop((d, off), None)

    def _compute(self, req: Request, n: int) -> None:
        """The forward pass: write the KV of the next n tokens, then insert full blocks."""
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            for g in self.groups:
                self.slots[self._slot(req, pos, g)] = _identity(req.cache_salt, req.token_ids,
                                                                pos)
        req.num_computed_tokens += n
        self.history.append((req.token_ids[: req.num_computed_tokens], req.cache_salt))
        before = [list(t) for t in self.kv.group_block_tables(req)]
        self.kv.cache_full_blocks(req)
        afters = self.kv.group_block_tables(req)
        for g_before, after in zip(before, afters):
            assert len(after) == len(g_before)
            for i, (old, new) in enumerate(zip(g_before, after)):
                if old != new:  # a duplicate full block swapped for the cached one of equal
                    assert (i + 1) * self.bs <= req.num_computed_tokens  # content
                    assert self.kv.pool.cached[new]
                    assert new not in g_before
        self.tables[req.request_id] = [list(t) for t in afters]

    def _new_prompt(self, data) -> tuple[list[int], str | None]:
        """A fresh random prompt, or (mostly) one that repeats or extends what an earlier
        request computed, cut anywhere or at a block boundary, usually in the same namespace."""
        if not self.history or data.draw(st.integers(0, 3)) == 0:
            tokens = data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=12))
            return tokens, data.draw(st.sampled_from(SALTS))
        base, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.one_of(st.just(len(base)),
                                  st.integers(0, len(base) // self.bs).map(lambda b: b * self.bs),
                                  st.integers(0, len(base))))
        extra = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, ALPHABET - 1),
                                                          min_size=1, max_size=8)))
        if data.draw(st.integers(0, 4)) == 0:
            salt = data.draw(st.sampled_from(SALTS))
        return (list(base[:cut]) + extra or [0]), salt

    def _admit(self, req: Request, data) -> None:
        kv = self.kv
        match = kv.match(req)
        limit = req.num_tokens - 1
        assert match.num_tokens <= max(limit, 0)
        assert len(match.nodes) * self.bs + match.partial_len == match.num_tokens
        # The match serves exactly this request's prefix: matched blocks and the partial
        # source hold its own KV, in its own salt namespace; in every group, from the group's
        # window at the hit point (a hit must be valid in every group at once).
        group_nodes = match.group_nodes or [match.nodes]
        assert len(group_nodes) == len(self.groups) or not match.nodes
        firsts = []
        for g, nodes in enumerate(group_nodes):
            assert len(nodes) == len(match.nodes)
            # From the window's first block at the hit point, never past the last matched
            # node (new blocks are published under it).
            first = min(self._first_block(match.num_tokens, g), max(len(nodes) - 1, 0))
            firsts.append(first)
            for pos in range(first * self.bs, match.num_tokens):
                i, off = divmod(pos, self.bs)
                block = nodes[i].block if i < len(nodes) else match.partial.block
                assert block != NULL_BLOCK, f"a hit serves a hollow block in group {g}"
                assert self.slots.get((block, off)) == \
                    _identity(req.cache_salt, req.token_ids, pos), \
                    f"prefix hit at position {pos} serves someone else's KV (group {g})"
        if match.partial is not None:
            assert 0 < match.partial_len < self.bs and len(self.groups) == 1
        remaining = req.num_tokens - match.num_tokens
        n = data.draw(st.integers(1, remaining))
        free_before = kv.pool.num_free
        idle_before = kv.pool.num_cached_idle
        others = self._held_by_others(req.request_id)
        admission = kv.admit(req, match, n)
        if admission is None:
            assert req.request_id not in kv.block_tables, "a refused admission holds blocks"
            assert (kv.pool.num_free, kv.pool.num_cached_idle) == (free_before, idle_before)
            self.preempted.append(req)  # back to waiting
            return
        self.queries += req.num_tokens
        self.hits += match.num_tokens
        assert admission.num_computed_tokens == match.num_tokens
        req.num_computed_tokens = admission.num_computed_tokens  # the scheduler's part
        tables = kv.group_block_tables(req)
        held = []
        for table, first, nodes in zip(tables, firsts, group_nodes + [[]] * len(self.groups)):
            assert table[first: len(match.nodes)] == [n.block for n in nodes[first:]]
            assert table[:first] == [NULL_BLOCK] * first, "a hit holds blocks before its window"
            fresh = table[len(match.nodes):]
            assert not set(fresh) & others, "a block held by a live request was handed out again"
            held += [b for b in table if b != NULL_BLOCK]
        assert len(set(held)) == len(held)
        plan = kv.end_step()  # the runner executes the plan before the forward pass
        assert not plan.saves and not plan.loads, "no tiers: nothing to save or load"
        self._copy([s for s, _ in plan.copies], [d for _, d in plan.copies])
        self.tables[req.request_id] = [list(t) for t in tables]
        self.live[req.request_id] = req
        self._compute(req, n)

    # -- operations -------------------------------------------------------------------------
    @rule(data=st.data())
    def admit_new(self, data):
        """Match and lock: a new request, often sharing a prefix with an earlier one."""
        while len(self.live) >= MAX_LIVE:  # a sequence limit, like max_num_seqs: one finishes
            self._finish(data.draw(st.sampled_from(sorted(self.live))), False)
        tokens, salt = self._new_prompt(data)
        prio = data.draw(st.integers(0, 3))
        req = _request(f"r{self.next_id}", tokens, salt, prio)
        self.next_id += 1
        self._admit(req, data)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data):
        """A preempted or refused request comes back and (usually) hits its own blocks."""
        req = self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1)))
        self._admit(req, data)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), rounds=st.integers(1, 4))
    def step(self, data, rounds):
        """A few engine steps of one running request: prefill chunks, then decodes."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        for _ in range(rounds):
            if req.num_uncomputed_tokens == 0:  # sample a token
                req.token_ids.append(data.draw(st.integers(0, ALPHABET - 1)))
            n = data.draw(st.integers(1, req.num_uncomputed_tokens))
            others = self._held_by_others(rid)
            befores = [list(t) for t in self.kv.group_block_tables(req)]
            ok = self.kv.allocate_slots(req, n)
            tables = self.kv.group_block_tables(req)
            for g, (before, table) in enumerate(zip(befores, tables)):
                first = self._first_block(req.num_computed_tokens, g)
                # Only blocks wholly before the window are released (room or not).
                assert all(b in (NULL_BLOCK, old) for b, old in zip(table[:first], before))
                assert table[first:len(before)] == before[first:]
            self.tables[rid] = [list(t) for t in tables]
            if not ok:
                assert all(len(t) == len(b) for t, b in zip(tables, befores))
                missing = self.kv.blocks_for_tokens(req.num_computed_tokens + n) \
                    - len(befores[0])
                assert missing * len(tables) > self.kv.pool.num_available
                return
            for before, table in zip(befores, tables):
                assert not set(table[len(before):]) & others, "a held block was allocated again"
            self._compute(req, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data, preempt):
        """Unlock: finish or abort a request, or preempt it (it will be recomputed)."""
        self._finish(data.draw(st.sampled_from(sorted(self.live))), preempt)

    def _finish(self, rid: str, preempt: bool) -> None:
        req = self.live.pop(rid)
        self.kv.free(req)
        del self.tables[rid]
        assert rid not in self.kv.block_tables
        if preempt:
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.preempted.append(req)

    @rule(n=st.one_of(st.integers(0, 3), st.integers(0, 50)), group=st.integers(0, 2))
    def evict(self, n, group):
        index = self.kv.groups[group % len(self.groups)].index
        nodes = [(node, node.block) for node in _tree_nodes(index)]
        children = {id(node): list(node.children.values()) for node, _ in nodes}
        idle = self.kv.pool.num_cached_idle
        done = len(index.evict(n))
        assert done <= min(n, idle)
        remaining = {id(node) for node in _tree_nodes(index)}
        evicted = [(node, block) for node, block in nodes if block != NULL_BLOCK
                   and (id(node) not in remaining or node.block == NULL_BLOCK)]
        assert len(evicted) == done
        for node, block in evicted:
            assert self.kv.pool.ref_counts[block] == 0, "a locked block was evicted"
            if id(node) in remaining:  # hollowed: only a windowed index keeps such nodes
                assert index.window is not None and node.children
                continue
            assert all(id(c) not in remaining for c in children[id(node)]), \
                "a parent was evicted before its child"
        if done < n:  # asked for more than it gave: nothing idle may be left in this index
            assert not any(self.kv.pool.ref_counts[node.block] == 0
                           for node in _tree_nodes(index) if node.block != NULL_BLOCK)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def pin(self, data):
        """Pin an earlier prefix if the device holds it whole (and the fraction allows)."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        probe = _request("pin-probe", list(tokens) + [0], salt)
        try:
            pin = self.kv.pins.pin(probe, len(tokens))
        except PinLimitError:
            return
        if pin is not None:
            self.pins.append(pin.id)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert self.kv.pins.unpin(pin_id) is not None

    @precondition(lambda self: self.live)
    @rule(data=st.data(), priority=st.integers(0, 100),
          ttl=st.one_of(st.none(), st.floats(0.5, 5.0)), end=st.integers(0, 12))
    def retain(self, data, priority, ttl, end):
        """A live request's cached blocks get a retention (as the scheduler gives them)."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        ret = Retention((RetentionRange(end or None, priority, ttl),))
        retain_sequence(self.kv, req, ret, len(req.prompt_token_ids))

    @rule(dt=st.floats(0.0, 3.0))
    def tick(self, dt):
        self.now += dt

    @rule(data=st.data(), group=st.integers(0, 2))
    def drop(self, data, group):
        """An audit's verdict on a random node: it and its subtree leave the index."""
        index = self.kv.groups[group % len(self.groups)].index
        nodes = [n for n in _tree_nodes(index)]
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        for n in index.drop(node):
            assert n.dropped

    @rule(data=st.data())
    def pressure(self, data):
        """Someone takes blocks: idle cached ones are evicted to make room, held ones never.
        Everything the pool calls available must really be obtainable."""
        pool = self.kv.pool
        n = data.draw(st.one_of(st.just(pool.num_available), st.integers(0, pool.num_free + 2)))
        n = min(n, pool.num_available)
        held = {b for ts in self.tables.values() for t in ts for b in t if b != NULL_BLOCK}
        blocks = self.kv.allocate_blocks(n)
        assert len(set(blocks)) == n
        assert not set(blocks) & held, "a block held by a live request was handed out"
        for b in blocks:
            for off in range(self.bs):
                self.slots[(b, off)] = ("garbage", b)
        pool.release(blocks)

    @rule(really=st.integers(0, 2))
    def reset(self, really):
        if really:  # resets are rare in real life, and they make every later match empty
            return
        self.kv.reset_prefix_cache()
        assert len(self.kv.pins) == 0, "a reset lets go of every pin"
        self.pins.clear()
        assert all(g.index.num_cached_blocks == 0 for g in self.kv.groups)
        assert self.kv.pool.num_cached_idle == 0
        for req in self.live.values():
            assert self.kv.match(req).num_tokens == 0

    # -- checks -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.check_invariants(list(self.live.values()))
        assert {r: [list(t) for t in kv.group_block_tables(self.live[r])]
                for r in kv.block_tables} == self.tables, \
            "a block table changed behind its request's back"
        check_index_evictable(kv)
        assert kv.pool.num_free + kv.pool.num_cached_idle + sum(
            1 for c in kv.pool.ref_counts if c > 0) == kv.num_blocks
        # Every live request still finds its own KV at every position it can read.
        for req in self.live.values():
            for g in self.groups:
                for pos in self._readable(req, g):
                    assert self.slots.get(self._slot(req, pos, g)) == \
                        _identity(req.cache_salt, req.token_ids, pos), \
                        f"request {req.request_id} lost its KV at position {pos} (group {g})"
        assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (self.queries, self.hits)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in list(self.live.values()):
            self.kv.free(req)
        for pin_id in self.pins:
            self.kv.pins.unpin(pin_id)
        self.kv.check_invariants([])
        assert not self.kv.block_tables
        for g in self.kv.groups:
            g.index.evict(10**9)
            assert g.index.num_cached_blocks == 0
        assert self.kv.pool.num_free == self.kv.num_blocks, "blocks leaked"
        assert self.kv.pool.ref_counts == [0] * self.kv.num_blocks


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # no "explain" phase: on a failure it can take minutes; the shrunk steps are printed anyway
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


# -- deterministic helpers for the unit tests below -------------------------------------------
class Driver:
    """Run requests through a manager the way the engine does: admit, compute the whole
    prompt, insert its full blocks, finish."""

    def __init__(self, num_blocks=64, block_size=2, policy="lru"):
        self.kv = KVCacheManager(num_blocks, block_size, True, policy)
        self.n = 0

    def run(self, tokens, priority=0, salt=None, keep=False) -> Request:
        req = _request(f"q{self.n}", tokens, salt, priority)
        self.n += 1
        match = self.kv.match(req)
        admission = self.kv.admit(req, match, req.num_tokens - match.num_tokens)
        assert admission is not None
        req.num_cached_tokens = admission.num_computed_tokens  # the scheduler's part
        self.kv.end_step()
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_full_blocks(req)
        if not keep:
            self.kv.free(req)
        return req

    def cached(self, tokens, salt=None) -> int:
        """How many leading tokens of `tokens` (+ one more, never matched) are cached."""
        return self.kv.match(_request("probe", list(tokens) + [0], salt)).num_tokens


def _seq(first: int, blocks: int, bs: int = 2) -> list[int]:
    return [first * 100 + i for i in range(blocks * bs)]


def test_lru_evicts_least_recently_used_leaf_first():
    d = Driver(policy="lru")
    a, b, c = _seq(1, 1), _seq(2, 1), _seq(3, 1)
    for s in (a, b, c):
        d.run(s)
    d.run(a + [7])  # a hit on a: a is now the most recently used
    assert d.cached(a) == 2
    assert len(d.kv.index.evict(1)) == 1
    assert (d.cached(a), d.cached(b), d.cached(c)) == (2, 0, 2)  # b went first
    assert len(d.kv.index.evict(1)) == 1
    assert (d.cached(a), d.cached(c)) == (2, 0)
    assert len(d.kv.index.evict(5)) == 1
    assert d.kv.index.num_cached_blocks == 0


class _SameKey:
    """A policy under which every block ties: the index's tie rule alone decides."""

    name, online = "same_key", True

    def key(self, node) -> tuple[int, ...]:
        return (0,)


def test_ties_go_to_the_block_that_became_evictable_first():
    """Equal keys evict in the order the leaves went idle, whatever their block ids, hashes or
    insertion order (a, b, c inserted; freed c, a, b)."""
    d = Driver(policy=_SameKey())
    seqs = {"a": _seq(1, 1), "b": _seq(2, 1), "c": _seq(3, 1)}
    held = {name: d.run(s, keep=True) for name, s in seqs.items()}
    for name in ("c", "a", "b"):
        d.kv.free(held[name])
    order = []
    for _ in range(3):
        assert len(d.kv.index.evict(1)) == 1
        order += [name for name, s in seqs.items() if d.cached(s) == 0 and name not in order]
    assert order == ["c", "a", "b"]
    # the same leaves idle again in another order: the new order wins, not the old one
    for name in ("b", "c", "a"):
        held[name] = d.run(seqs[name], keep=True)
    for name in ("a", "b", "c"):
        d.kv.free(held[name])
    order = []
    for _ in range(3):
        d.kv.index.evict(1)
        order += [name for name, s in seqs.items() if d.cached(s) == 0 and name not in order]
    assert order == ["a", "b", "c"]


def test_lfu_evicts_least_hit_first():
    d = Driver(policy="lfu")
    a, b, c = _seq(1, 1), _seq(2, 1), _seq(3, 1)
    for s in (a, b, c):
        d.run(s)
    for _ in range(3):
        d.run(a + [7])
    d.run(c + [7])
    d.run(b + [7])  # b: one hit, but the most recent one
    for _ in range(2):
        d.run(c + [8])
    # uses (insertion + hits): a 4, b 2, c 4 -> b first; a and c tie on count and the tie
    # goes to the least recently used, a.
    order = []
    for _ in range(3):
        before = {name: d.cached(s) for name, s in (("a", a), ("b", b), ("c", c))}
        assert len(d.kv.index.evict(1)) == 1
        after = {name: d.cached(s) for name, s in (("a", a), ("b", b), ("c", c))}
        order += [name for name in before if before[name] and not after[name]]
    assert order == ["b", "a", "c"]


def test_lfu_count_beats_recency():
    d = Driver(policy="lfu")
    a, b = _seq(1, 1), _seq(2, 1)
    d.run(a)
    d.run(b)
    for _ in range(4):
        d.run(a + [7])
    d.run(b + [7])  # b is the most recent, but a is hit far more often
    d.kv.index.evict(1)
    assert (d.cached(a), d.cached(b)) == (2, 0)


def test_priority_evicts_lowest_priority_first():
    d = Driver(policy="priority")
    low, high, mid = _seq(1, 1), _seq(2, 1), _seq(3, 1)
    d.run(high, priority=5)
    d.run(mid, priority=2)
    d.run(low, priority=0)  # the most recent, yet the first to go
    d.run(high + [7], priority=0)  # a low-priority hit keeps the node's priority
    names = (("low", low), ("mid", mid), ("high", high))
    order = []
    for _ in range(3):
        before = {n: d.cached(s) for n, s in names}
        d.kv.index.evict(1)
        order += [n for n, _ in names if before[n] and not d.cached(dict(names)[n])]
    assert order == ["low", "mid", "high"]


def test_lru_differs_from_priority_on_the_same_history():
    """The same history, two policies: they must not both be plain LRU."""
    victims = {}
    for policy in ("lru", "priority"):
        d = Driver(policy=policy)
        d.run(_seq(1, 1), priority=9)
        d.run(_seq(2, 1), priority=0)
        d.kv.index.evict(1)
        victims[policy] = 1 if d.cached(_seq(1, 1)) == 0 else 2
    assert victims == {"lru": 1, "priority": 2}


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
def test_eviction_is_leaf_first(policy):
    """A parent never goes before its children, whatever the policy prefers: here the root
    blocks are the least recently used, least hit and lowest priority of all."""
    d = Driver(num_blocks=64, block_size=2, policy=policy)
    trunk = _seq(1, 3)  # three blocks
    d.run(trunk, priority=0)
    branch_a = trunk[:4] + [501, 502, 503, 504]
    branch_b = trunk[:2] + [601, 602]
    d.run(branch_a + [9], priority=3)
    d.run(branch_b + [9], priority=3)
    for _ in range(3):  # the deep leaves get many recent hits
        d.run(trunk + [9], priority=4)
        d.run(branch_a + [9], priority=4)
    index = d.kv.index
    total = index.num_cached_blocks
    assert total == 3 + 2 + 1
    while index.num_cached_blocks:
        parents = {id(n.parent) for n in _tree_nodes(index)}
        before = {id(n): n for n in _tree_nodes(index)}
        assert len(index.evict(1)) == 1
        after = {id(n) for n in _tree_nodes(index)}
        (gone,) = [n for k, n in before.items() if k not in after]
        assert id(gone) not in parents, "an inner node was evicted before its children"
        d.kv.check_invariants([])
        check_index_evictable(d.kv)
    assert d.kv.pool.num_free == d.kv.num_blocks


def test_held_prefix_is_never_evicted():
    d = Driver(num_blocks=8, block_size=2)
    held = d.run(_seq(1, 3), keep=True)  # 3 blocks, locked by a running request
    d.run(_seq(2, 3))  # 3 idle cached blocks
    assert len(d.kv.index.evict(100)) == 3
    assert d.cached(_seq(1, 3)) == 6
    got = d.kv.pool.allocate(d.kv.pool.num_available)
    assert not set(got) & set(d.kv.block_tables[held.request_id])
    d.kv.pool.release(got)
    d.kv.free(held)
    assert len(d.kv.index.evict(100)) == 3
    assert d.kv.pool.num_free == 8


def test_duplicate_full_block_does_not_strand_idle_blocks():
    """Regression: a request that computes a block the index already holds (an identical,
    block-aligned prompt whose last block came through copy-on-write) must not leave that
    cached block idle above its own held blocks: the pool counts idle blocks as available, so
    they must be evictable, or an allocation the pool promised raises NoFreeBlocksError."""
    d = Driver(num_blocks=8, block_size=2)
    prompt = [5, 6, 7, 8]
    d.run(prompt)  # two cached blocks, idle
    req = d.run(prompt, keep=True)  # hit of 3 tokens: block 0 shared, block 1 by copy
    assert req.num_cached_tokens == 3
    req.token_ids += [9, 10]  # decode two tokens: a third block under the cached second one
    assert d.kv.allocate_slots(req, 2)
    req.num_computed_tokens += 2
    d.kv.cache_full_blocks(req)
    d.kv.check_invariants([req])
    check_index_evictable(d.kv)
    blocks = d.kv.allocate_blocks(d.kv.pool.num_available)  # all it promised
    d.kv.pool.release(blocks)
    d.kv.free(req)
    d.kv.index.evict(100)
    assert d.kv.pool.num_free == 8


def test_salts_are_separate_namespaces():
    d = Driver()
    tokens = _seq(1, 3)
    d.run(tokens, salt="a")
    assert d.cached(tokens, salt="a") == 6
    assert d.cached(tokens, salt="b") == 0
    assert d.cached(tokens) == 0
    # not even a partial (copy-on-write) hit across namespaces
    assert d.kv.match(_request("p", tokens[:1] + [0], "b")).num_tokens == 0
    assert d.kv.match(_request("p", tokens[:1] + [0], "a")).num_tokens == 1


def test_reset_forgets_everything_and_leaks_nothing():
    d = Driver(num_blocks=16)
    running = d.run(_seq(1, 3), keep=True)
    d.run(_seq(2, 3))
    d.kv.reset_prefix_cache()
    assert d.kv.index.num_cached_blocks == 0
    assert d.cached(_seq(1, 3)) == d.cached(_seq(2, 3)) == 0
    # the running request keeps its blocks and goes on
    d.kv.check_invariants([running])
    assert len(d.kv.block_tables[running.request_id]) == 3
    running.token_ids += [1, 2]
    assert d.kv.allocate_slots(running, 2)
    running.num_computed_tokens += 2
    d.kv.cache_full_blocks(running)  # inserts nothing: its cache was reset under it
    assert d.kv.index.num_cached_blocks == 0
    d.kv.free(running)
    assert d.kv.pool.num_free == 16


# -- eviction cost ----------------------------------------------------------------------------
class _CountingHeapq:
    """Stands in for the heapq module inside prefix_index and counts heap operations."""

    def __init__(self):
        import heapq
        self._heapq = heapq
        self.pops = 0
        self.pushes = 0

    def heappop(self, heap):
        self.pops += 1
        return self._heapq.heappop(heap)

    def heappush(self, heap, item):
        self.pushes += 1
        return self._heapq.heappush(heap, item)

    def heapify(self, heap):
        return self._heapq.heapify(heap)


def _index_with_idle_leaves(n: int) -> PrefixIndex:
    """n one-block sequences, all idle: n evictable leaves under one root."""
    pool = BlockPool(n)
    index = PrefixIndex(pool, 1, "lru")
    root = index.root(b"")
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        index.insert(root, (i,), chain_hashes([i], 1)[0], b)
    index.mark_idle(pool.release(blocks))
    assert pool.num_cached_idle == n
    return index


def test_eviction_cost_does_not_grow_with_the_number_of_idle_leaves(monkeypatch):
    counter = _CountingHeapq()
    monkeypatch.setattr(prefix_index_module, "heapq", counter)
    timings = {}
    for n in (10_000, 100_000):
        index = _index_with_idle_leaves(n)
        counter.pops = counter.pushes = 0
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            assert len(index.evict(1000)) == 1000
            best = min(best, time.perf_counter() - t)
        # O(1) heap operations per eviction: one pop each, no pushes (no parent to requeue)
        assert counter.pops == 3000, counter.pops
        assert counter.pushes == 0
        timings[n] = best
        assert index.pool.num_free == 3000
    # O(log n): 10x more leaves should cost far less than 10x more time
    assert timings[100_000] < 5 * timings[10_000] + 0.005, timings
