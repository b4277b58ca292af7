"""Speculative decoding drafted from the KV cache (kvserve/spec/, worker/spec_verify.py).

The reference is the same engine with speculation off: greedy outputs must be equal token for
token (with prefix caching, chunked prefill, preemption, stop strings and tokens, logprobs),
every step passes the scheduler/KV invariants (tests/conftest.py) and every run ends with every
block back in the pool (helpers.generate_checked). Each speculating run must also show drafts
accepted, so none of this can pass with speculation silently off. The rejection sampler is
checked alone against the target distribution with a chi-square test.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generate_checked, kv_bytes_per_token, random_prompts, save_random_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.sampling import SamplingParams as SP
from kvserve.spec.config import load_speculative_config
from kvserve.spec.ngram import ngram_draft
from kvserve.worker.spec_verify import _row, verify
from kvserve.worker.step import SeqSampling
from kvserve.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}


# -- config ------------------------------------------------------------------------------------
def test_config_shape_and_refusals():
    cfg = load_speculative_config('{"method": "ngram", "num_speculative_tokens": 5}')
    assert cfg.num_speculative_tokens == 5 and cfg.prompt_lookup_max == 5
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prompt_lookup_maximum'\]"):
        load_speculative_config({"method": "ngram", "prompt_lookup_maximum": 3})
    with pytest.raises(ValueError, match="unknown key.*'model'"):
        load_speculative_config({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="draft model 'x.gguf' does not exist"):
        load_speculative_config({"method": "draft_model", "model": "x.gguf"})
    with pytest.raises(ValueError, match="method must be one of"):
        load_speculative_config({"method": "eagle"})
    with pytest.raises(ValueError, match="prompt_lookup_min .* must be <="):
        load_speculative_config({"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        load_speculative_config({"num_speculative_tokens": 0})


def test_feature_table_refuses_incompatible_combinations():
    with pytest.raises(ValueError, match=r"speculative decoding \(ngram\) cannot run over an "
                                         r"int4"):
        EngineConfig(speculative_config=NGRAM, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="bounded KV cache"):
        EngineConfig(speculative_config=NGRAM, bounded_kv_policy="streaming_llm",
                     bounded_kv_budget=64)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="method 'suffix' drafts from the prefix index"):
        EngineConfig(speculative_config={"method": "suffix"}, enable_prefix_caching=False)


# -- the drafter -------------------------------------------------------------------------------
def test_ngram_draft_takes_the_longest_latest_match():
    assert ngram_draft([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    # [2, 3] occurs twice before: the latest occurrence continues with 7
    assert ngram_draft([2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 2, 4) == [7, 1]
    # the longer match [1, 2, 3] wins over the latest [2, 3]
    assert ngram_draft([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 1, 2, 3) == [4]
    assert ngram_draft([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_draft([5, 6, 5], 4, 1, 2) == [6, 5]


def test_suffix_draft_follows_the_longest_match_and_the_most_used_branch():
    from types import SimpleNamespace

    from kvserve.kv.block_pool import BlockPool
    from kvserve.kv.prefix_index import PrefixIndex
    from kvserve.spec.config import SpeculativeConfig
    from kvserve.spec.suffix import SuffixDrafter

    pool = BlockPool(16)
    index = PrefixIndex(pool, 4)
    b = pool.allocate(4)
    n1 = index.insert(index.root(b""), [1, 2, 3, 4], 101, b[0])
    n2 = index.insert(n1, [5, 6, 7, 8], 102, b[1])
    n3 = index.insert(n1, [5, 6, 9, 9], 103, b[2])
    index.insert(n2, [10, 11, 12, 13], 104, b[3])
    index.touch([n3, n3])  # the branch used most
    kv = SimpleNamespace(groups=[SimpleNamespace(index=index)])
    drafter = SuffixDrafter(kv, SpeculativeConfig(method="suffix", prompt_lookup_min=2,
                                                  prompt_lookup_max=4))

    def draft(tokens, k, salt=None):
        return drafter(SimpleNamespace(token_ids=tokens, cache_salt=salt), k)

    assert draft([0, 3, 4, 5, 6], 3) == [9, 9]  # both branches match 4 tokens: n3 is used more
    assert draft([0, 9, 9, 5, 6], 1) == [9]
    assert draft([6, 7], 5) == [8, 10, 11, 12, 13]  # on across a block boundary
    assert draft([3, 4], 6) == [5, 6, 9, 9]  # from the end of a block into its most used child
    assert draft([7, 7], 3) == []
    assert draft([6, 7], 3, salt="other") == []  # another namespace's blocks draft nothing
    n4 = index.insert(index.root(b""), [6, 7, 42, 43], 105, pool.allocate(1)[0])
    index.touch([n4] * 5)
    assert draft([0, 6, 7], 2) == [42, 43]  # new blocks are found; equal matches: more used


# -- verification ------------------------------------------------------------------------------
def _state(params: SP, seed: int | None = None) -> SeqSampling:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SeqSampling(params, [1], [], frozenset(), seed, gen)


def test_greedy_verification_keeps_the_agreeing_run():
    logits = torch.full((4, 8), -5.0)
    for row, token in enumerate([3, 4, 6, 1]):
        logits[row, token] = 5.0
    state = _state(SP(temperature=0.0))
    assert verify(Sampler(), logits, state, [3, 4, 5])[0] == [3, 4, 6]  # third rejected
    assert verify(Sampler(), logits, state, [3, 4, 6])[0] == [3, 4, 6, 1]  # + the bonus
    assert verify(Sampler(), logits, state, [2, 4, 6])[0] == [3]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    probs = probs.double()[keep]
    expected = probs / probs.sum() * counts[keep].double().sum()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("params,draft", [(SP(temperature=1.0), 2), (SP(temperature=0.7), 5),
                                          (SP(temperature=1.0, top_k=3), 0)])
def test_rejection_sampling_keeps_the_target_distribution(params, draft):
    """Whatever the draft, the first kept token is distributed as the target row 0 (after
    temperature and top-k), and given that the draft was kept, the second as row 1."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    sampler = Sampler(seed=1)
    state = _state(params, seed=7)
    target = sampler.distribution(logits[:1], [_row(state, None)])[0].double()
    second = sampler.distribution(logits[1:], [_row(state, None, [draft])])[0]
    first_counts, second_counts = torch.zeros(6), torch.zeros(6)
    for _ in range(3000):
        kept, _ = verify(sampler, logits, state, [draft])
        first_counts[kept[0]] += 1
        if len(kept) == 2:
            second_counts[kept[1]] += 1
    assert _chi_square_p(first_counts, target) > 1e-3
    if second_counts.sum() > 200:
        assert _chi_square_p(second_counts, second.double()) > 1e-3


def test_seeded_verification_is_reproducible():
    logits = torch.randn(3, 16)
    runs = []
    for _ in range(2):
        state = _state(SP(temperature=1.0, seed=3), seed=3)
        runs.append([verify(Sampler(seed=5), logits, state, [1, 2])[0] for _ in range(20)])
    assert runs[0] == runs[1]


# -- the decode kernels a verification's rows run -----------------------------------------------
# A verification's k + 1 rows run beside each other in one decode step (worker/model_runner.py's
# _draft_rows); greedy with speculation equals greedy without only if a row's result does not
# depend on how many rows share the call. Each kernel's rows alone against the same rows in
# calls of 2 to 9 and 16 rows, bit for bit.
_ROW_COUNTS = (2, 3, 4, 5, 6, 7, 8, 9, 16)


def _rows_alone_and_together(op, k: int, seed: int) -> None:
    x = torch.randn(max(_ROW_COUNTS), k, generator=torch.Generator().manual_seed(seed)) * 3
    alone = torch.cat([op(x[r:r + 1].clone()) for r in range(x.shape[0])])
    for rows in _ROW_COUNTS:
        together = op(x[:rows].clone())
        bad = [r for r in range(rows) if not torch.equal(together[r], alone[r])]
        assert not bad, f"{rows} rows: rows {bad} differ from the same rows alone"


def test_float_gemv_rows_are_independent():
    from kvserve.kernels.cpu import gemv

    kern = gemv.load()
    if kern is None:
        pytest.skip("no C++ compiler")
    w = torch.randn(70, 320, generator=torch.Generator().manual_seed(1))  # n not of 4
    for mode in (gemv.MODE_STORE, gemv.MODE_SILU_MUL):
        _rows_alone_and_together(kern.bind(w, None, mode), 320, seed=2)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("layout", ["rows", "tiles", "float_x"])
def test_quantized_gemv_rows_are_independent(isa, type_name, layout):
    from test_quant_kquants import K_TYPES, _kblocks
    from test_quant_linear import ISAS, _kernel, _weight

    from kvserve.kernels.cpu import qgemv

    if layout == "float_x" and type_name != "Q8_0":
        pytest.skip("float x: Q8_0 only (the LM head's)")
    kern = _kernel(dict(ISAS)[isa])
    n, k = 64, 256 * 3 if type_name in K_TYPES else 32 * 19
    wq, _ = (_kblocks if type_name in K_TYPES else _weight)(type_name, n, k, seed=3)
    tiled = layout == "tiles"
    if tiled:
        wq = kern.pack_tiles(wq, type_name, k)
    for mode in (qgemv.MODE_STORE, qgemv.MODE_SILU_MUL):
        if layout == "float_x" and mode != qgemv.MODE_STORE:
            continue
        op = kern.bind(wq, type_name, k, None, mode, layout == "float_x", tiled)
        _rows_alone_and_together(op, k, seed=4)


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random Llama whose greedy continuation depends on the whole context (the make-model
    tiny checkpoint mostly repeats its prompt's last token)."""
    from conftest import _hf_config

    return save_random_checkpoint(_hf_config("llama"), tmp_path_factory.mktemp("spec") / "l")


def _prompts() -> list[dict]:
    """Prompts that repeat (the drafter's case) and random ones (nothing to draft)."""
    motif = [11, 12, 13, 14, 15, 16, 17]
    ids = [motif * 6, [40, 41, 42] * 10 + [7, 8], *random_prompts([30, 9], 512, seed=3)]
    return [{"prompt_token_ids": p} for p in ids]


def _run(path, spec, params, prompts=None, **kw):
    llm = LLM(model=str(path), speculative_config=spec, seed=0, **kw)
    outs = generate_checked(llm, prompts or _prompts(), params)
    return outs, llm.engine.stats()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", ["prefix_caching", "no_prefix_caching", "chunked",
                                  "recompute", "swap"])
def test_greedy_equals_no_speculation(llama_dir, case):
    # a pool of 30 blocks of 4 tokens for 4 requests of up to 82 tokens: preemptions
    small = {"block_size": 4, "kv_cache_memory_bytes": 30 * 4 * kv_bytes_per_token(llama_dir)}
    kw = {"prefix_caching": {}, "no_prefix_caching": {"enable_prefix_caching": False},
          # chunked prefill beside the drafts (a 16-token budget shared with them)
          "chunked": {"max_num_batched_tokens": 16, "max_model_len": 256},
          "recompute": {**small, "preemption_mode": "recompute"},
          "swap": {**small, "preemption_mode": "swap"},
          }[case]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # with the cache on, every prompt twice: the second copy hits the first's blocks
    prompts = _prompts() * 2 if case == "prefix_caching" else None
    ref, _ = _run(llama_dir, None, params, prompts, **kw)
    outs, stats = _run(llama_dir, NGRAM, params, prompts, **kw)
    counters = stats.spec_decode
    assert _ids(outs) == _ids(ref)
    if case in ("recompute", "swap"):
        assert stats.num_preemptions > 0
    if case == "swap":
        assert stats.swap["swapped_in"] > 0
    if case == "prefix_caching":
        assert stats.prefix_cache_hits > 0
    assert counters["num_accepted_tokens"] > 0, counters
    assert sum(o.metrics.num_accepted_tokens for o in outs) == counters["num_accepted_tokens"]
    assert sum(o.metrics.num_draft_tokens for o in outs) == counters["num_draft_tokens"]


SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
          "prompt_lookup_max": 8}


def test_suffix_greedy_equals_no_speculation(llama_dir):
    """The suffix drafter drafts from the cached blocks: the prompts' and, after the first
    round, the earlier answers' (the same prompts again, with other max_tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = _prompts()
    ref, _ = _run(llama_dir, None, params, prompts + prompts)
    outs, stats = _run(llama_dir, SUFFIX, params, prompts + prompts)
    assert _ids(outs) == _ids(ref)
    assert stats.spec_decode["num_accepted_tokens"] > 0, stats.spec_decode


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory):
    """Mistral with a window of 8 on every layer (blocks outside it are released) and a Qwen2
    hybrid (a sliding and a full layer: two KV groups, two tables)."""
    import transformers
    from conftest import DECODE_COMMON

    root = tmp_path_factory.mktemp("spec_windows")
    return {
        "window": save_random_checkpoint(transformers.MistralConfig(
            **DECODE_COMMON, tie_word_embeddings=False, rope_theta=1e4, sliding_window=8),
            root / "mistral_window"),
        "hybrid": save_random_checkpoint(transformers.Qwen2Config(
            **DECODE_COMMON, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            root / "qwen2_hybrid"),
    }


@pytest.mark.parametrize("case", ["int8", "fp8", "window", "hybrid"])
def test_greedy_equals_no_speculation_on_quantized_and_windowed_kv(llama_dir, window_dirs,
                                                                   case):
    """Quantized KV (a rejected draft's slot is rewritten with the kept token's KV) and
    sliding windows (blocks released behind the window, one table or one per group)."""
    path = window_dirs.get(case, llama_dir)
    kw = {"int8": {"kv_cache_dtype": "int8"}, "fp8": {"kv_cache_dtype": "fp8"},
          "window": {"block_size": 4}, "hybrid": {"block_size": 4}}[case]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref, _ = _run(path, None, params, **kw)
    outs, stats = _run(path, NGRAM, params, **kw)
    assert _ids(outs) == _ids(ref)
    assert stats.spec_decode["num_accepted_tokens"] > 0, stats.spec_decode


def test_stops_logprobs_and_lengths_as_without_speculation(llama_dir):
    ref_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref, _ = _run(llama_dir, None, ref_params)
    # a stop token and a stop string that the first output reaches part-way, odd max_tokens
    stop = _ids(ref)[0][17]
    text = ref[3].outputs[0].text
    stop_str = text[len(text) // 2:len(text) // 2 + 3]
    params = [SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True,
                             stop_token_ids=[stop], logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.2),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, min_tokens=5,
                             stop=[stop_str], logprobs=0)]
    off, _ = _run(llama_dir, None, params)
    on, stats = _run(llama_dir, NGRAM, params)
    assert stats.spec_decode["num_accepted_tokens"] > 0
    assert off[3].outputs[0].stop_reason == stop_str
    for a, b in zip(off, on):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].stop_reason == b.outputs[0].stop_reason
        if a.outputs[0].logprobs is not None:
            assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs)
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-3 for t in x)
            assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-2


def test_seeded_sampling_is_reproducible_with_speculation(llama_dir):
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=11)
    first, stats = _run(llama_dir, NGRAM, params)
    second, _ = _run(llama_dir, NGRAM, params)
    assert _ids(first) == _ids(second)
    assert stats.spec_decode["num_drafts"] > 0


@pytest.fixture(scope="module")
def smollm2_reference():
    """SmolLM2 (the embedded default model, its quantized GGUF kernels) without speculation:
    greedy answers, with each token's logprob, to prompts that quote their context (the
    drafters' case): a paragraph to repeat, a question on it, and a Python file to rewrite with
    one change (where the multi-row kernels of the first verification path once turned near
    ties the other way). Deterministic (issue 64), as are the engines compared with it: where
    this CPU's measured plan runs MKL above a few rows (AVX2), a verification's rows would
    otherwise take other float steps than one-token decodes."""
    from pathlib import Path

    text = ("The KV cache keeps the keys and values of every token a request has computed, in "
            "blocks of sixteen tokens. A block that fills is published to the prefix index, so "
            "that a later request with the same prefix reads it instead of computing it again.")
    source = (Path(__file__).resolve().parent.parent / "kvserve" / "spec" / "ngram.py"
              ).read_text()
    convs = [[{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{text}"}],
             [{"role": "user", "content": f"{text}\n\nWhat is published to the prefix index?"}],
             [{"role": "user", "content": "Rewrite this Python file, renaming `ngram_draft` to "
               f"`lookup_draft`. Output the whole file.\n\n```python\n{source}```"}]]
    llm = LLM(seed=0, max_model_len=4096, deterministic=True)
    assert llm.engine.model.decode_step.max_rows is not None  # the one-call quantized step
    tok = llm.engine.tokenizer
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        c, add_generation_prompt=True), add_special_tokens=False)} for c in convs]
    params = SamplingParams(temperature=0.0, max_tokens=96, logprobs=0)
    outs = generate_checked(llm, prompts, params)
    return prompts, params, _ids(outs), _logprobs(outs)


def _logprobs(outs) -> list[list[float]]:
    """Each kept token's logprob: equal floats only where its logits row has the same bits."""
    return [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_smollm2_greedy_equals_no_speculation(smollm2_reference, method):
    """Token for token, and each token's logprob bit for bit: a verification's rows run as
    one-token decode rows (the one-call quantized step, the paged kernel, the head's one-row
    kernel), so they compute what decoding one token at a time computes (deterministic: on
    every CPU, whatever its measured GEMM plan)."""
    prompts, params, expected, logprobs = smollm2_reference
    llm = LLM(seed=0, max_model_len=4096, deterministic=True,
              speculative_config={"method": method, "num_speculative_tokens": 4})
    outs = generate_checked(llm, prompts, params)
    assert _ids(outs) == expected
    assert _logprobs(outs) == logprobs
    assert llm.engine.stats().spec_decode["num_accepted_tokens"] > 0


def test_prometheus_names_the_spec_decode_counters():
    from kvserve.server.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    counts = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5,
              "accepted_per_pos": [3, 2, 0]}
    logger._spec_metrics(counts)
    logger._spec_metrics(dict(counts, num_drafts=4))  # counters grow by the difference
    text = logger.render().decode()
    assert 'kvserve:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert ('kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="1"} 2.0') in text


def test_speculation_turns_itself_down():
    """A request whose drafts are rejected drafts fewer, then pauses; drafting measured slower
    than plain decoding stops for everyone but seeded requests; a large batch drafts nothing."""
    from types import SimpleNamespace

    from kvserve.spec.config import SpeculativeConfig
    from kvserve.spec.speculator import _PAUSE_STEPS, _THROTTLE_STEPS, Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8),
                      drafter=lambda request, k: [7] * k)
    assert not spec.active(8) and spec.active(7)
    req = SimpleNamespace(token_ids=[1, 2], sampling_params=SP(), spec_state=None,
                          num_draft_tokens=0, num_accepted_tokens=0)
    widths = []
    for _ in range(12):
        draft = spec.propose(req, 10)
        widths.append(len(draft))
        if draft:
            spec.record(req, len(draft), 0)
    assert widths[0] == 4 and 0 < min(w for w in widths if w) < 4 and widths[-1] == 0
    assert req.num_draft_tokens == sum(widths) and req.spec_state.pause > _PAUSE_STEPS - 12
    assert spec.counters.num_drafts == sum(1 for w in widths if w)

    fresh = SimpleNamespace(token_ids=[1, 2], sampling_params=SP(), spec_state=None,
                            num_draft_tokens=0, num_accepted_tokens=0)
    seeded = SimpleNamespace(token_ids=[1, 2], sampling_params=SP(seed=1), spec_state=None,
                             num_draft_tokens=0, num_accepted_tokens=0)
    for _ in range(4):
        spec.observe_step(False, 1, 0.01)  # 100 tokens/s without drafts
        spec.observe_step(True, 2, 0.04)  # 50 with them: it does not pay
    assert spec.steps.throttled == _THROTTLE_STEPS
    assert spec.active(1)
    assert spec.propose(fresh, 10) == [] and spec.propose(seeded, 10) == [7] * 4
    for _ in range(_THROTTLE_STEPS):
        spec.active(1)
    assert not spec.throttled and spec.propose(fresh, 10) == [7] * 4


# -- the server --------------------------------------------------------------------------------
def _serve_and_ask(tmp_path, name: str, args: list[str]) -> list:
    """Start `kvserve serve` on SmolLM2 with `args`, ask it two greedy questions through the
    official openai client (chat and completions), stop it; the responses."""
    import openai
    from gguf_files import smollm2_path
    from server_process import ServerProcess

    text = ("The KV cache keeps the keys and values of every token a request has computed, in "
            "blocks of sixteen tokens. A block that fills is published to the prefix index.")
    proc = ServerProcess(name, [str(smollm2_path()), "--served-model-name", "m", *args],
                         tmp_path, max_model_len=1024)
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Repeat exactly:\n\n{text}"}],
            temperature=0.0, max_tokens=64)
        completion = client.completions.create(model="m", prompt=f"{text}\n\n{text[:60]}",
                                               temperature=0.0, max_tokens=48)
        return [chat, completion]
    finally:
        assert proc.stop() is None, proc.log()[-3000:]


@pytest.mark.timeout(600)
def test_server_outputs_and_usage_with_speculation(tmp_path):
    """A real `kvserve serve --speculative-config` against the same server without it: the
    same greedy text, and the usage carries the drafted and accepted token counts (absent
    without speculation)."""
    off = _serve_and_ask(tmp_path, "spec-off", [])
    on = _serve_and_ask(tmp_path, "spec-on", [
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert on[0].choices[0].message.content == off[0].choices[0].message.content
    assert on[1].choices[0].text == off[1].choices[0].text
    for a, b in zip(off, on):
        assert "num_draft_tokens" not in (a.usage.model_extra or {})
        extra = b.usage.model_extra
        assert extra["num_draft_tokens"] > 0 and 0 < extra["num_accepted_tokens"] \
            <= extra["num_draft_tokens"], extra
        assert b.usage.completion_tokens == a.usage.completion_tokens
