"""Built-in workloads: traces of token ids (and one of block hashes) with known sharing.

Each generator is seeded and returns a `Trace`; with `rate` (requests per second) the requests
get Poisson arrival times, otherwise none (then the simulator replays them one after another).

- system_prompt: every request = one of a few shared system prompts + a unique user message.
- few_shot: one fixed instruction + k examples per task (MMLU-style: 57 tasks), then a unique
  question; tasks drawn uniformly or by a Zipf law.
- rag: a system prompt, then k documents retrieved from a corpus with Zipf popularity, in
  retrieval order, then a question: sharing stops at the first document that differs.
- multi_turn: chat sessions; turn t's prompt is the whole conversation so far (system prompt,
  earlier user turns and the assistant's answers) plus a new user message; sessions interleave.
- gsp: SGLang's generated-shared-prefix benchmark: groups x prompts per group, each prompt =
  its group's system prompt + a unique question (defaults 64 x 16, 2,048 + 128 tokens, 256 out).
- hash_mix: a block-hash trace in the Mooncake format (512-token blocks, millisecond timestamps)
  mixing popular system prompts and multi-turn sessions; sized for the replay benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvserve.sim.trace import Trace, TraceRequest


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return rng.choices(range(vocab), k=n)


def _jitter(rng: random.Random, n: int, jitter: float) -> int:
    """n, or a length drawn uniformly from [n (1 - jitter), n (1 + jitter)] (at least 1)."""
    if jitter <= 0:
        return n
    return max(1, round(rng.uniform(n * (1 - jitter), n * (1 + jitter))))


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    if s <= 0:
        return lambda: rng.randrange(n)
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    population = list(range(n))
    return lambda: rng.choices(population, weights)[0]


def _finish(requests: list[TraceRequest], name: str, params: dict, rate: float | None,
            seed: int) -> Trace:
    trace = Trace(requests, source=f"generator:{name}", params=params)
    if rate:
        trace.with_poisson_arrivals(rate, seed)
    return trace


def system_prompt(num_requests: int = 1000, system_prompt_len: int = 1024,
                  num_system_prompts: int = 1, user_len: int = 256, output_len: int = 128,
                  length_jitter: float = 0.0, vocab: int = 32000, seed: int = 0,
                  rate: float | None = None) -> Trace:
    params = dict(locals())
    rng = random.Random(seed)
    systems = [_tokens(rng, system_prompt_len, vocab) for _ in range(num_system_prompts)]
    reqs = []
    for _ in range(num_requests):
        user = _tokens(rng, _jitter(rng, user_len, length_jitter), vocab)
        p = systems[rng.randrange(num_system_prompts)] + user
        reqs.append(TraceRequest(len(p), _jitter(rng, output_len, length_jitter), None, p))
    return _finish(reqs, "system_prompt", params, rate, seed)


def few_shot(num_requests: int = 1000, num_tasks: int = 57, shots: int = 5, shot_len: int = 160,
             instruction_len: int = 32, question_len: int = 96, output_len: int = 16,
             zipf: float = 0.0, vocab: int = 32000, seed: int = 0,
             rate: float | None = None) -> Trace:
    params = dict(locals())
    rng = random.Random(seed)
    instruction = _tokens(rng, instruction_len, vocab)
    prefixes = [instruction + _tokens(rng, shots * shot_len, vocab) for _ in range(num_tasks)]
    pick = _zipf_picker(rng, num_tasks, zipf)
    reqs = []
    for _ in range(num_requests):
        p = prefixes[pick()] + _tokens(rng, question_len, vocab)
        reqs.append(TraceRequest(len(p), output_len, None, p))
    return _finish(reqs, "few_shot", params, rate, seed)


def rag(num_requests: int = 1000, num_docs: int = 2000, docs_per_request: int = 4,
        doc_len: int = 512, system_prompt_len: int = 256, question_len: int = 64,
        output_len: int = 128, zipf: float = 1.1, vocab: int = 32000, seed: int = 0,
        rate: float | None = None) -> Trace:
    params = dict(locals())
    rng = random.Random(seed)
    system = _tokens(rng, system_prompt_len, vocab)
    docs: dict[int, list[int]] = {}
    pick = _zipf_picker(rng, num_docs, zipf)
    reqs = []
    for _ in range(num_requests):
        chosen: list[int] = []
        while len(chosen) < min(docs_per_request, num_docs):
            d = pick()
            if d not in chosen:
                chosen.append(d)
        p = list(system)
        for d in chosen:
            if d not in docs:
                docs[d] = _tokens(rng, doc_len, vocab)
            p += docs[d]
        p += _tokens(rng, question_len, vocab)
        reqs.append(TraceRequest(len(p), output_len, None, p))
    return _finish(reqs, "rag", params, rate, seed)


def multi_turn(num_sessions: int = 200, turns: int = 6, system_prompt_len: int = 512,
               user_len: int = 128, output_len: int = 256, think_time_s: float = 30.0,
               length_jitter: float = 0.0, vocab: int = 32000, seed: int = 0,
               rate: float | None = None) -> Trace:
    """With `rate`, sessions start as a Poisson process of rate/turns sessions per second and each
    next turn follows after an exponential think time; without, turns of different sessions are
    interleaved at random (each session's turns in order). `length_jitter` j draws each user
    message and answer length uniformly from [n (1 - j), n (1 + j)]."""
    params = dict(locals())
    rng = random.Random(seed)
    system = _tokens(rng, system_prompt_len, vocab)
    sessions: list[list[TraceRequest]] = []
    for _ in range(num_sessions):
        history = list(system)
        conv = []
        for _ in range(turns):
            prompt = history + _tokens(rng, _jitter(rng, user_len, length_jitter), vocab)
            answer = _tokens(rng, _jitter(rng, output_len, length_jitter), vocab)
            conv.append(TraceRequest(len(prompt), len(answer), None, prompt, None, answer))
            history = prompt + answer
        sessions.append(conv)
    reqs: list[TraceRequest] = []
    if rate:
        t = 0.0
        for conv in sessions:
            t += rng.expovariate(rate / turns)
            at = t
            for r in conv:
                r.timestamp = at
                at += rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
                reqs.append(r)
        reqs.sort(key=lambda r: r.timestamp)
    else:
        next_turn = [0] * num_sessions
        live = list(range(num_sessions))
        while live:
            k = rng.randrange(len(live))
            s = live[k]
            reqs.append(sessions[s][next_turn[s]])
            next_turn[s] += 1
            if next_turn[s] == turns:
                live[k] = live[-1]
                live.pop()
    return Trace(reqs, source="generator:multi_turn", params=params)


def gsp(num_groups: int = 64, prompts_per_group: int = 16, system_prompt_len: int = 2048,
        question_len: int = 128, output_len: int = 256, shuffle: bool = True, vocab: int = 32000,
        seed: int = 0, rate: float | None = None) -> Trace:
    params = dict(locals())
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_groups):
        prefix = _tokens(rng, system_prompt_len, vocab)
        for _ in range(prompts_per_group):
            p = prefix + _tokens(rng, question_len, vocab)
            reqs.append(TraceRequest(len(p), output_len, None, p))
    if shuffle:
        rng.shuffle(reqs)
    return _finish(reqs, "gsp", params, rate, seed)


def hash_mix(num_requests: int = 100_000, block_size: int = 512, num_system_prompts: int = 50,
             system_blocks: int = 4, zipf: float = 1.0, continue_prob: float = 0.45,
             live_sessions: int = 2000, new_blocks: int = 6, output_len: int = 300,
             rate: float = 10.0, seed: int = 0) -> Trace:
    """A Mooncake-shaped block-hash trace: each request either continues a live session (its
    previous prompt's full blocks + blocks for the answer and the new message) or opens a new
    one (a Zipf-popular system prompt of 1..2*system_blocks blocks + 1..2*new_blocks fresh
    blocks). The last block is partial; arrivals are Poisson at `rate` per second."""
    params = dict(locals())
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(rng.randint(1, 2 * system_blocks)) for _ in range(num_system_prompts)]
    pick = _zipf_picker(rng, num_system_prompts, zipf)
    sessions: list[list[int]] = []  # full-block hash ids of each live session's last prompt
    reqs = []
    t = 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out = max(1, int(rng.expovariate(1.0 / output_len)))
        if sessions and rng.random() < continue_prob:
            k = rng.randrange(len(sessions))
            prev = sessions[k]
            ids = prev + fresh(-(-out // block_size) + rng.randint(1, 2))
            if len(ids) > 64:  # the conversation outgrew the context: start over
                ids = systems[pick()] + fresh(rng.randint(1, 2 * new_blocks))
        else:
            k = None
            ids = systems[pick()] + fresh(rng.randint(1, 2 * new_blocks))
        n = len(ids) * block_size - rng.randrange(block_size)
        reqs.append(TraceRequest(n, out, t, None, ids))
        full = ids[:-1]  # the partial last block is not part of the next turn's prefix
        if k is None:
            if len(sessions) < live_sessions:
                sessions.append(full)
            else:
                sessions[rng.randrange(live_sessions)] = full
        else:
            sessions[k] = full
    return Trace(reqs, block_size=block_size, source="generator:hash_mix", params=params)


GENERATORS: dict[str, Callable[..., Trace]] = {
    "system_prompt": system_prompt, "few_shot": few_shot, "rag": rag,
    "multi_turn": multi_turn, "gsp": gsp, "hash_mix": hash_mix,
}


def generate(name: str, **kwargs) -> Trace:
    key = name.replace("-", "_")
    if key == "generated_shared_prefix":
        key = "gsp"
    if key not in GENERATORS:
        raise ValueError(f"generator must be one of {', '.join(GENERATORS)}, got {name!r}")
    try:
        return GENERATORS[key](**kwargs)
    except TypeError as e:
        raise ValueError(f"generator {key}: {e}") from e


def parse_gen_options(items: list[str] | None) -> dict:
    """["num_groups=8", "rate=2.5", "shuffle=false"] -> {"num_groups": 8, "rate": 2.5, ...}"""
    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"generator option {item!r} is not KEY=VALUE")
        v = value.strip()
        if v.lower() in ("true", "false"):
            out[key.strip()] = v.lower() == "true"
            continue
        try:
            out[key.strip()] = int(v)
        except ValueError:
            try:
                out[key.strip()] = float(v)
            except ValueError:
                out[key.strip()] = v
    return out
