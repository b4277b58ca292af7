"""Prefix caching through the engine.

1. Greedy (and seeded) token ids are the same with caching on and off on the workloads prefix
   caching exists for (shared system prompt, few-shot, RAG, multi-turn chat, n > 1, a pool small
   enough to force evictions and preemptions), for block sizes 1, 7, 16 and 64, and equal to
   transformers' own greedy generate on one of them. Every cached run must show hits, so none of
   this can pass with caching silently off.
2. Hit accounting is exact: on a generated-shared-prefix workload the measured hit rate equals
   the best any cache could do, computed by hand from the prompts.
3. cache_salt isolation, reset_prefix_cache, in-batch sharing, lpm scheduling.

Every engine step is followed by the engine's invariant check and a check that every idle cached
block is evictable (what the pool counts as available), and every run ends with no block held.
"""

from __future__ import annotations

import random

import pytest
from helpers import hf_greedy, kv_bytes_per_token
from test_prefix_properties import check_index_evictable

from kvserve import LLM, SamplingParams

VOCAB = 2048  # the tiny model's
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
BLOCK_SIZES = [1, 7, 16, 64]
HF_VOCAB = 512  # the conftest checkpoints'


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ref_model(hf_checkpoints):
    """For token-for-token comparisons: conftest's Llama checkpoint, whose weights are spread
    wide enough that the greedy continuation depends on the whole context. (The make-model tiny
    checkpoint mostly repeats the prompt's last token, whatever KV it attends to: an on/off
    comparison on it would pass with a corrupted cache.)"""
    return hf_checkpoints["llama"]


def make_llm(model_dir, pool_tokens: int = 8192, **kwargs) -> LLM:
    """An LLM whose every step is followed by the invariant checks. The pool defaults to a few
    thousand tokens: the checks walk every block, every step."""
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory_bytes", pool_tokens * kv_bytes_per_token(model_dir))
    llm = LLM(model=str(model_dir), **kwargs)
    engine = llm.engine
    step = engine.step

    def checked_step():
        outputs = step()
        engine.check_invariants()
        check_index_evictable(engine.kv)
        return outputs

    engine.step = checked_step
    return llm


def generate(llm: LLM, prompts, params=GREEDY, **kwargs):
    """llm.generate on token-id prompts; afterwards no request holds a block."""
    outs = llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts],
                        params, use_tqdm=False, **kwargs)
    kv = llm.engine.kv
    assert not kv.block_tables and kv.num_available_blocks == kv.num_blocks, "KV blocks leaked"
    return outs


def tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- 1. caching on == caching off -------------------------------------------------------------
class Workloads:
    """Each workload runs on an LLM and returns (token ids per sample, num_cached_tokens per
    request, the least num_cached_tokens each request must show when caching is on)."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB):
        rng = random.Random(seed)

        def t(n):
            return tokens(rng, n, vocab)

        self.system = t(40)  # shorter than a 64-token block: hit by copy-on-write
        self.questions = [t(30) for _ in range(5)]
        self.header = t(12)
        self.shots = [t(25) for _ in range(4)]
        self.queries = [t(10) for _ in range(4)]
        self.document = t(150)
        self.rag_questions = [t(45) for _ in range(5)]
        self.chat_system = t(70)
        self.user_turns = [t(10) for _ in range(4)]
        self.n_prompt = t(100)

    @staticmethod
    def _two_phases(llm, first, rest, shared):
        """The first prompt alone, then the rest in one call; each later prompt must hit at
        least the `shared` prefix it has with the first."""
        a = generate(llm, [first])
        b = generate(llm, rest)
        outs = a + b
        return ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs],
                [0] + [shared] * len(rest))

    def system_prompt(self, llm):
        prompts = [self.system + q for q in self.questions]
        return self._two_phases(llm, prompts[0], prompts[1:], len(self.system))

    def few_shot(self, llm):
        four = self.header + sum(self.shots, [])
        two = self.header + self.shots[0] + self.shots[1]
        prompts = [four + q for q in self.queries[:3]] + [two + self.queries[3]]
        out_tokens, cached, _ = self._two_phases(llm, prompts[0], prompts[1:], 0)
        least = [0, len(four), len(four), len(two)]
        return out_tokens, cached, least

    def rag(self, llm):
        prompts = [self.document + q for q in self.rag_questions]
        return self._two_phases(llm, prompts[0], prompts[1:], len(self.document))

    def chat(self, llm):
        """Turn k's prompt is turn k-1's prompt + its answer + the new user tokens. What turn
        k-1 left in the cache is every full block of the tokens it computed (its prompt and its
        answer but the last token, which was sampled and never fed back)."""
        llm.reset_prefix_cache()  # so that the hits are exactly predictable
        bs = llm.engine.config.block_size
        prompt = self.chat_system + self.user_turns[0]
        out_tokens, cached, least = [], [], []
        expected = 0
        for turn in range(len(self.user_turns)):
            (out,) = generate(llm, [prompt])
            answer = out.outputs[0].token_ids
            out_tokens.append(answer)
            cached.append(out.num_cached_tokens)
            least.append(expected)
            if llm.engine.kv.index.enabled:
                assert out.num_cached_tokens == expected, (turn, out.num_cached_tokens, expected)
                assert out.metrics.num_cached_tokens == expected
            computed = len(prompt) + len(answer) - 1
            expected = computed // bs * bs
            if turn + 1 < len(self.user_turns):
                prompt = prompt + answer + self.user_turns[turn + 1]
        return out_tokens, cached, least

    def n_greedy(self, llm):
        """n = 3 greedy samples of a cold prompt: samples 2 and 3 wait one step for the blocks
        sample 1 computes, then hit them (the engine counters show it)."""
        hits = llm.engine.kv.prefix_cache_hits
        params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW, ignore_eos=True)
        (out,) = generate(llm, [self.n_prompt], params)
        samples = [c.token_ids for c in out.outputs]
        assert samples[0] == samples[1] == samples[2]
        got = llm.engine.kv.prefix_cache_hits - hits
        if llm.engine.kv.index.enabled:
            assert got > 0, "the n > 1 samples did not share their prompt"
        return samples, [got], [1]

    def n_seeded(self, llm):
        """n = 3 seeded random samples: each sample's generator is seeded, so the samples do
        not depend on scheduling, and must not depend on where the prompt's KV came from."""
        hits = llm.engine.kv.prefix_cache_hits
        params = SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=NEW,
                                ignore_eos=True)
        (out,) = generate(llm, [self.document + self.questions[0]], params)
        samples = [c.token_ids for c in out.outputs]
        assert len({tuple(s) for s in samples}) > 1, "seeded sampling gave identical samples"
        got = llm.engine.kv.prefix_cache_hits - hits
        return samples, [got], [1]


WORKLOAD_NAMES = ["system_prompt", "few_shot", "rag", "chat", "n_greedy", "n_seeded"]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cached_equals_uncached(ref_model, block_size):
    on = make_llm(ref_model, block_size=block_size)
    off = make_llm(ref_model, block_size=block_size, enable_prefix_caching=False)
    w = Workloads(vocab=HF_VOCAB)
    for name in WORKLOAD_NAMES:
        got_on, cached_on, least = getattr(w, name)(on)
        got_off, cached_off, _ = getattr(w, name)(off)
        assert got_on == got_off, f"{name}: token ids differ with prefix caching on"
        assert all(c == 0 for c in cached_off), f"{name}: hits with caching off"
        for i, (c, want) in enumerate(zip(cached_on, least)):
            assert c >= want, f"{name}: request {i} hit {c} tokens, expected >= {want}"
        assert sum(cached_on) > 0, f"{name}: no prefix-cache hit at all"
    stats = on.engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert off.engine.stats().prefix_cache_hits == 0


def test_block_64_hits_a_short_prefix_by_copy_on_write(tiny_model_dir):
    """A shared prefix shorter than one block is still served: the cached block is copied and
    the request computes only its own tail."""
    llm = make_llm(tiny_model_dir, block_size=64)
    rng = random.Random(7)
    system = tokens(rng, 40)
    a, b = system + tokens(rng, 30), system + tokens(rng, 30)
    generate(llm, [a])
    (out,) = generate(llm, [b])
    assert out.num_cached_tokens == 40 + lcp(a[40:], b[40:])
    assert out.num_cached_tokens > 0
    # and a prompt that is a strict prefix of a cached block hits all but its last token
    (out,) = generate(llm, [a[:50]])
    assert out.num_cached_tokens == 49


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_small_pool_evicts_and_preempts(ref_model, block_size):
    """A pool of ~400 tokens for batches of 6 requests of up to ~200 tokens: requests are
    preempted and cached blocks evicted, and the token ids do not change."""
    rng = random.Random(11)
    document = tokens(rng, 150, HF_VOCAB)
    system = tokens(rng, 60, HF_VOCAB)
    batches = [[document + tokens(rng, 20, HF_VOCAB) for _ in range(3)]
               + [system + tokens(rng, 30, HF_VOCAB) for _ in range(3)] for _ in range(3)]
    batches.append([document + tokens(rng, 20, HF_VOCAB) for _ in range(2)] + [batches[0][3]])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    num_blocks = -(-400 // block_size)
    pool = num_blocks * block_size * kv_bytes_per_token(ref_model)
    results = {}
    for caching in (True, False):
        llm = make_llm(ref_model, block_size=block_size, enable_prefix_caching=caching,
                       kv_cache_memory_bytes=pool, max_model_len=512)
        assert llm.engine.kv.num_blocks == num_blocks
        outs = [generate(llm, batch, params) for batch in batches]
        results[caching] = [o.outputs[0].token_ids for batch in outs for o in batch]
        if caching:
            cached = [o.num_cached_tokens for batch in outs for o in batch]
            assert sum(cached) > 0
            assert llm.engine.kv.index.num_evicted_blocks > 0, "nothing was evicted"
            assert llm.engine.scheduler.num_preemptions > 0, "nothing was preempted"
            assert llm.engine.stats().num_evicted_blocks > 0
    assert results[True] == results[False]


def test_repeated_block_aligned_prompt_under_pressure(ref_model):
    """Regression: the same block-aligned prompt again, its last block served by copy-on-write
    and then recomputed equal to the cached one, while another request fills the pool. The
    engine used to keep the duplicate private and leave the cached block idle above the
    request's later blocks: counted as available, never evictable, so the next allocation the
    pool had promised raised NoFreeBlocksError."""
    results = {}
    for caching in (True, False):
        llm = make_llm(ref_model, block_size=4, max_model_len=64,
                       enable_prefix_caching=caching,
                       kv_cache_memory_bytes=10 * 4 * kv_bytes_per_token(ref_model))
        prompt = list(range(10, 18))  # two full blocks
        first = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                       ignore_eos=True))
        outs = generate(llm, [prompt, list(range(100, 120))],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        results[caching] = [o.outputs[0].token_ids for o in first + outs]
        if caching:
            assert outs[0].num_cached_tokens == 7
    assert results[True] == results[False]


# -- transformers as the reference ------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "phi3", "olmo2"])
def hf_workload(hf_checkpoints, request):
    """Shared system prompt and RAG prompts, and transformers' greedy continuations of each, on
    Qwen3 and on the two families issue 30 added through the registry (Phi-3's permuted partial
    RoPE and OLMo 2's post-norms reach the cached K/V too)."""
    rng = random.Random(3)
    system = tokens(rng, 45, HF_VOCAB)
    document = tokens(rng, 180, HF_VOCAB)
    prompts = ([system + tokens(rng, 25, HF_VOCAB) for _ in range(4)]
               + [document + tokens(rng, 12, HF_VOCAB) for _ in range(4)])
    path = hf_checkpoints[request.param]
    return path, prompts, hf_greedy(path, prompts, 10)


@pytest.mark.parametrize("block_size", [7, 64])
def test_cached_runs_match_transformers(hf_workload, block_size):
    path, prompts, expected = hf_workload
    llm = make_llm(path, block_size=block_size, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # one system prompt and one document first, then the rest in one batch hitting them
    first = generate(llm, [prompts[0], prompts[4]], params)
    rest = generate(llm, prompts[1:4] + prompts[5:], params)
    outs = first[:1] + rest[:3] + first[1:] + rest[3:]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 45 for o in rest[:3])
    assert all(o.num_cached_tokens >= 180 for o in rest[3:])


# -- 2. exact hit accounting ------------------------------------------------------------------
def shared_prefix_workload(seed: int = 0, groups: int = 8, per_group: int = 8,
                           prefix_len: int = 1024, question_len: int = 64):
    """SGLang's generated-shared-prefix workload: per group a random prefix, per prompt a random
    question; some questions repeat the start of an earlier one of their group, so that hits
    also end inside the question. Submission order is shuffled across groups."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = tokens(rng, prefix_len)
        questions: list[list[int]] = []
        for _ in range(per_group):
            q = tokens(rng, question_len)
            if questions and rng.random() < 0.4:
                shared = rng.randrange(1, 21)
                q = rng.choice(questions)[:shared] + q[shared:]
            questions.append(q)
        prompts += [prefix + q for q in questions]
    rng.shuffle(prompts)
    return prompts


def best_possible_hits(prompts: list[list[int]]) -> list[int]:
    """For each prompt in submission order, the most a prefix cache could serve: its longest
    common prefix with any earlier prompt, leaving the last token to compute."""
    return [min(max((lcp(p, q) for q in prompts[:i]), default=0), len(p) - 1)
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def gsp_workload():
    prompts = shared_prefix_workload()
    return prompts, best_possible_hits(prompts)


@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 64])
def test_hit_rate_is_the_theoretical_maximum(tiny_model_dir, gsp_workload, block_size):
    prompts, expected = gsp_workload
    assert len(prompts) == 64 and all(len(p) == 1088 for p in prompts)
    # max_tokens=1: the sampled token is never computed, so each request caches exactly the
    # full blocks of its prompt; every common prefix ends before the last full block, so the
    # cache holds all of it and partial-block (copy-on-write) hits make it token-exact.
    assert max(expected) < len(prompts[0]) // block_size * block_size
    first_of_group: dict[tuple, int] = {}
    for i, p in enumerate(prompts):
        first_of_group.setdefault(tuple(p[:1024]), i)
    firsts = set(first_of_group.values())
    assert len(firsts) == 8
    assert all(expected[i] == 0 for i in firsts)  # a group's first prompt: nothing to hit
    assert all(expected[i] >= 1024 for i in range(64) if i not in firsts)
    assert any(e > 1024 for e in expected), "no question shares a start with an earlier one"

    llm = make_llm(tiny_model_dir, block_size=block_size, max_model_len=1100,
                   pool_tokens=72 * 1024)  # holds the whole workload: nothing is evicted
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    got = []
    for p in prompts:  # one after another
        (out,) = generate(llm, [p], params)
        got.append(out.num_cached_tokens)
        assert out.metrics.num_cached_tokens == out.num_cached_tokens
    kv = llm.engine.kv
    assert kv.index.num_evicted_blocks == 0
    assert got == expected
    assert kv.prefix_cache_queries == sum(len(p) for p in prompts)
    assert kv.prefix_cache_hits == sum(expected)
    rate = kv.prefix_cache_hits / kv.prefix_cache_queries
    assert rate == sum(expected) / (64 * 1088)
    assert rate > 0.8  # 7/8 of the prompts hit 1024+ of their 1088 tokens
    stats = llm.engine.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == \
        (kv.prefix_cache_hits, kv.prefix_cache_queries)


def test_hit_accounting_through_add_request(tiny_model_dir):
    """The same accounting driven by add_request + stepping to completion, per request."""
    prompts = shared_prefix_workload(seed=5, groups=2, per_group=4, prefix_len=200,
                                     question_len=30)
    expected = best_possible_hits(prompts)
    llm = make_llm(tiny_model_dir, block_size=16)
    engine = llm.engine
    got = []
    for p in prompts:
        rid = engine.add_request({"prompt_token_ids": p},
                                 SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == rid and out.finished
                got.append(out.num_cached_tokens)
    assert got == expected
    assert engine.kv.prefix_cache_hits == sum(expected)


# -- 3. salts, reset, in-batch sharing, lpm ---------------------------------------------------
def test_cache_salt_isolation(tiny_model_dir):
    llm = make_llm(tiny_model_dir, block_size=16)
    prompt = tokens(random.Random(1), 100)

    def run(salt):
        p = {"prompt_token_ids": prompt} if salt is None else \
            {"prompt_token_ids": prompt, "cache_salt": salt}
        (out,) = generate(llm, [p])
        return out

    first = run("tenant-a")
    assert first.num_cached_tokens == 0
    assert run("tenant-b").num_cached_tokens == 0  # same prompt, other salt: nothing shared
    assert run(None).num_cached_tokens == 0  # no salt is a namespace of its own
    again = run("tenant-a")
    assert again.num_cached_tokens == 96  # same salt: the full blocks
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert run("x" * 256).num_cached_tokens == 0  # the longest salt allowed
    assert run(None).num_cached_tokens == 96
    # add_request takes the salt as an argument too
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": prompt}, GREEDY, cache_salt="tenant-b")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].request_id == rid and outs[0].num_cached_tokens == 96


@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_invalid_cache_salt_is_refused(tiny_model_dir, salt):
    llm = make_llm(tiny_model_dir, block_size=16)
    prompt = [5, 6, 7]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt},
                      {"prompt_token_ids": prompt, "cache_salt": salt}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request({"prompt_token_ids": prompt}, GREEDY, cache_salt=salt)
    assert not llm.engine.has_unfinished_requests()  # the whole call was refused
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.num_blocks


def test_reset_prefix_cache(ref_model):
    rng = random.Random(2)
    prompts = [tokens(rng, 90, HF_VOCAB) for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    off = make_llm(ref_model, block_size=8, enable_prefix_caching=False)
    reference = [o.outputs[0].token_ids for o in generate(off, prompts, params)]

    llm = make_llm(ref_model, block_size=8)
    generate(llm, prompts[:1], params)
    assert generate(llm, prompts[:1], params)[0].num_cached_tokens == 89  # all but the last
    llm.reset_prefix_cache()
    kv = llm.engine.kv
    assert kv.index.num_cached_blocks == 0 and kv.pool.num_free == kv.num_blocks
    assert generate(llm, prompts[:1], params)[0].num_cached_tokens == 0

    # A reset while requests run: they go on unaffected, and nothing leaks.
    llm.reset_prefix_cache()
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] = out
    assert len(engine.scheduler.running) == 3 and not done
    assert kv.index.num_cached_blocks > 0
    llm.reset_prefix_cache()
    assert kv.index.num_cached_blocks == 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].outputs[0].token_ids for i in ids] == reference
    assert kv.index.num_cached_blocks == 0  # the running requests did not cache after the reset
    assert kv.pool.num_free == kv.num_blocks, "blocks leaked"
    # and caching works again afterwards
    generate(llm, prompts[1:2], params)
    assert generate(llm, prompts[1:2], params)[0].num_cached_tokens == 89


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("chunk", [None, 64])
def test_identical_prompts_in_one_call_share(ref_model, block_size, chunk):
    """The second of two identical prompts submitted together waits for the blocks the first
    is computing, then hits them (also when the first is prefilled in chunks)."""
    prompt = tokens(random.Random(4), 300, HF_VOCAB)
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = make_llm(ref_model, block_size=block_size, **kwargs)
    a, b = generate(llm, [prompt, prompt])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == min(300 // block_size * block_size, 299) > 0
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.kv.prefix_cache_hits == b.num_cached_tokens


def test_lpm_serves_the_longest_cached_prefix_first(ref_model):
    rng = random.Random(6)
    document = tokens(rng, 200, HF_VOCAB)
    x, z = tokens(rng, 120, HF_VOCAB), tokens(rng, 120, HF_VOCAB)
    y, w = document + tokens(rng, 20, HF_VOCAB), document + tokens(rng, 20, HF_VOCAB)
    batch = [x, y, z, w]
    orders, results = {}, {}
    for policy in ("fcfs", "lpm"):
        llm = make_llm(ref_model, block_size=16, max_num_seqs=1, scheduling_policy=policy)
        generate(llm, [document + tokens(rng, 5, HF_VOCAB)])  # the document is cached
        outs = generate(llm, batch)
        results[policy] = [o.outputs[0].token_ids for o in outs]
        start = [o.metrics.first_scheduled_time for o in outs]
        orders[policy] = sorted(range(4), key=lambda i: start[i])
        assert outs[1].num_cached_tokens >= 192 and outs[3].num_cached_tokens >= 192
    assert orders["fcfs"] == [0, 1, 2, 3]
    assert orders["lpm"][:2] == [1, 3]  # the two document questions first, in arrival order
    assert results["fcfs"] == results["lpm"]


def test_lpm_matches_fcfs_tokens_in_a_busy_batch(ref_model):
    w = Workloads(seed=9, vocab=HF_VOCAB)
    prompts = ([w.system + q for q in w.questions] + [w.document + q for q in w.rag_questions])
    random.Random(0).shuffle(prompts)
    outs = {}
    for policy in ("fcfs", "lpm"):
        llm = make_llm(ref_model, block_size=16, scheduling_policy=policy, max_num_seqs=3,
                       max_num_batched_tokens=128)
        got = generate(llm, prompts)
        outs[policy] = [o.outputs[0].token_ids for o in got]
        assert sum(o.num_cached_tokens for o in got) > 0
    assert outs["fcfs"] == outs["lpm"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
def test_eviction_policies_keep_tokens_equal(ref_model, policy):
    """Whatever is evicted, the output does not change; priority feeds the priority policy."""
    rng = random.Random(8)
    hot, cold = tokens(rng, 100, HF_VOCAB), tokens(rng, 100, HF_VOCAB)
    pair = [hot + tokens(rng, 10, HF_VOCAB), cold + tokens(rng, 10, HF_VOCAB)]
    prompts = pair * 2 + [tokens(rng, 110, HF_VOCAB) for _ in range(3)] + \
        [hot + tokens(rng, 10, HF_VOCAB), cold + tokens(rng, 10, HF_VOCAB)]
    pool = 24 * 16 * kv_bytes_per_token(ref_model)
    results = {}
    for caching in (True, False):
        llm = make_llm(ref_model, block_size=16, kv_cache_memory_bytes=pool,
                       enable_prefix_caching=caching, eviction_policy=policy)
        outs = [generate(llm, [p], priority=[5 if p[:100] == hot else 0])[0] for p in prompts]
        results[caching] = [o.outputs[0].token_ids for o in outs]
        if caching:
            assert llm.engine.kv.index.num_evicted_blocks > 0
            if policy == "priority":  # the high-priority prefix survived the pressure
                assert outs[-2].num_cached_tokens >= 96
    assert results[True] == results[False]


def test_a_request_needing_the_whole_pool_is_not_stuck_behind_its_partial_hit(ref_model):
    """A prompt that needs every block, with an idle cached block that it partially matches:
    copying from that block would need one block more than the pool has, and nothing running
    will free one. It must be admitted by computing that block instead, not wait forever, and
    decode transformers' tokens."""
    llm = make_llm(ref_model, pool_tokens=8 * 4, block_size=4, max_model_len=32)
    a = [random.Random(1).randrange(3, HF_VOCAB) for _ in range(8)]
    generate(llm, [a], SamplingParams(temperature=0.0, max_tokens=1))  # a's 2 blocks cached
    b = a[:6] + [random.Random(2).randrange(3, HF_VOCAB) for _ in range(25)]  # 31 + 1 = 32
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    match = llm.engine.kv.match(_probe(b))
    assert match.partial is not None and match.partial_len == 2, "the test's premise"
    (out,) = generate(llm, [b], params)
    assert out.outputs[0].token_ids == hf_greedy(ref_model, [b], 1)[0]
    assert out.num_cached_tokens == 4  # the full block; the partial one was computed


def _probe(tokens: list[int]):
    from kvserve.request import Request

    return Request("probe", tokens, SamplingParams(), 1)
