"""The field walk (issue 13, acceptance 4): every field of every request model in
kvserve/server/protocol.py is either honoured (a case below shows its effect on a real
`kvserve serve`) or refused with a 400 that names it. A field added to protocol.py without a
case here fails `test_every_field_has_a_case`.

One field is accepted for what it cannot do here: chat's `store` (OpenAI's stored
completions). OpenAI clients and frameworks send it, often as false, and OpenAI has it, so
refusing it as unknown would break them for nothing; kvserve stores no completion, as vLLM
does not, so `store: true` changes nothing and nothing can be fetched back (case_store). Its
companions `metadata` (validated as OpenAI documents it, echoed) and `service_tier` (OpenAI's
values; the answer names the tier that served, "default") are honoured. The completions
endpoint, which has none of the three at OpenAI, still refuses them as unknown.

Also: JSON null in every optional field is its default; unknown fields are refused (OpenAI's
behaviour, pinned here); echo and prompt_logprobs against transformers' log_softmax on the same
weights; streaming echo equals the non-streamed one; continuous_usage_stats.

The server runs the tiny random-weight model with a chat template of the test's own that
renders a message's `name` and a `kvserve_marker` template kwarg, so that the fields a
template consumes have a visible effect."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import BaseModel
from server_process import ServerProcess

from kvserve.model_loader.make_model import ensure_default_model
from kvserve.server import protocol

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
PROMPT = "alpha bravo charlie delta echo foxtrot golf"
MSGS = [{"role": "user", "content": PROMPT}]
TOL = 1e-4
TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] }}"
    "{%- if message['name'] is defined %}{{ ' ' + message['name'] }}{%- endif %}"
    "{%- if message['tool_call_id'] is defined %}{{ ' ' + message['tool_call_id'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined %}{{ message['tool_calls'] | tojson }}{%- endif %}"
    "{{ '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    "{%- if kvserve_marker is defined %}{{ kvserve_marker }}{%- endif %}")


# ------------------------------------------------------------------------------------------
# the server and two endpoint helpers
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    src = ensure_default_model()
    dst = tmp_path_factory.mktemp("fieldwalk") / "tiny"
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # every caller the admin: explain's cache_salt case reads the full report's salt reason
    srv = ServerProcess("fieldwalk", [str(model_dir), "--served-model-name", MODEL,
                                      "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                                      "--allow-unauthenticated-admin"],
                        tmp_path_factory.mktemp("fieldwalk-logs"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    assert code is None, srv.log()[-3000:]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from kvserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


DROP = object()  # a field left out of the body


class Endpoint:
    """One endpoint with a greedy default body of 8 tokens; `post(field=value)` overrides."""

    def __init__(self, url: str, chat: bool) -> None:
        self.url = url + ("/v1/chat/completions" if chat else "/v1/completions")
        self.chat = chat

    def body(self, **fields) -> dict:
        base = {"model": MODEL, "max_tokens": 8, "temperature": 0.0}
        base.update({"messages": MSGS} if self.chat else {"prompt": PROMPT})
        base.update(fields)
        return {k: v for k, v in base.items() if v is not DROP}

    def post(self, **fields) -> httpx.Response:
        return httpx.post(self.url, json=self.body(**fields), timeout=120)

    def ok(self, **fields) -> dict:
        r = self.post(**fields)
        assert r.status_code == 200, r.text[:1000]
        return r.json()

    def text(self, resp: dict, i: int = 0) -> str:
        choice = sorted(resp["choices"], key=lambda c: c["index"])[i]
        return choice["message"]["content"] if self.chat else choice["text"]

    def texts(self, **fields) -> list[str]:
        resp = self.ok(**fields)
        return [self.text(resp, i) for i in range(len(resp["choices"]))]

    def stream(self, **fields) -> list[dict]:
        with httpx.stream("POST", self.url, json=self.body(stream=True, **fields),
                          timeout=120) as r:
            assert r.status_code == 200, r.read()[:1000]
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(ln[6:]) for ln in lines[:-1]]

    def stream_text(self, chunks: list[dict]) -> str:
        key = (lambda c: c["delta"].get("content") or "") if self.chat else \
            (lambda c: c["text"])
        return "".join(key(c) for ch in chunks for c in ch["choices"])

    def refused(self, field: str, **fields) -> None:
        """A 400 in OpenAI's error shape that names the field."""
        r = self.post(**fields)
        assert r.status_code == 400, (field, r.status_code, r.text[:500])
        err = r.json()["error"]
        assert field in (err["param"] or "") or field in err["message"], (field, err)


@pytest.fixture(scope="module")
def comp(server) -> Endpoint:
    return Endpoint(server.url, chat=False)


@pytest.fixture(scope="module")
def chat(server) -> Endpoint:
    return Endpoint(server.url, chat=True)


def _unique_prompt(seed: int, words: int = 60) -> str:
    rng = random.Random(seed)
    vocab = ["kernel", "cache", "block", "token", "server", "batch", "alpha", "bravo",
             "charlie", "delta"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


# ------------------------------------------------------------------------------------------
# cases: one per (model, field); each shows the field's effect or its 400
# ------------------------------------------------------------------------------------------

def case_model(ep: Endpoint, ctx) -> None:
    assert ep.ok(model=MODEL)["model"] == MODEL
    assert ep.post(model="not-served").status_code == 404


def case_n(ep: Endpoint, ctx) -> None:
    assert len(ep.ok(n=3, temperature=1.0, seed=1)["choices"]) == 3


def case_temperature(ep: Endpoint, ctx) -> None:
    greedy = ep.texts(max_tokens=16)
    assert ep.texts(max_tokens=16, temperature=0.0) == greedy
    assert ep.texts(max_tokens=16, temperature=1.5, seed=3) != greedy


def _equals_greedy_when(ep: Endpoint, **knob) -> None:
    """A knob that, at its extreme, leaves only the most likely token: a seeded T=1 draw
    becomes the greedy text (and is not without the knob)."""
    greedy = ep.texts(max_tokens=16)
    sampled = {"max_tokens": 16, "temperature": 1.0, "seed": 11}
    assert ep.texts(**sampled) != greedy
    assert ep.texts(**sampled, **knob) == greedy


def case_top_p(ep, ctx) -> None:
    _equals_greedy_when(ep, top_p=1e-9)


def case_top_k(ep, ctx) -> None:
    _equals_greedy_when(ep, top_k=1)


def case_min_p(ep, ctx) -> None:
    _equals_greedy_when(ep, min_p=1.0)


def _changes_greedy(ep: Endpoint, **knob) -> None:
    base = ep.texts(max_tokens=32, ignore_eos=True)
    assert ep.texts(max_tokens=32, ignore_eos=True, **knob) != base


def case_presence_penalty(ep, ctx) -> None:
    _changes_greedy(ep, presence_penalty=2.0)


def case_frequency_penalty(ep, ctx) -> None:
    _changes_greedy(ep, frequency_penalty=2.0)


def case_repetition_penalty(ep, ctx) -> None:
    _changes_greedy(ep, repetition_penalty=3.0)


def case_seed(ep, ctx) -> None:
    a = ep.texts(temperature=1.0, seed=7, max_tokens=16)
    assert ep.texts(temperature=1.0, seed=7, max_tokens=16) == a
    assert ep.texts(temperature=1.0, seed=8, max_tokens=16) != a


def _stop_in(full: str) -> tuple[str, int]:
    """A 3-character stop string that first occurs inside `full`, past its start."""
    for at in range(1, len(full) - 3):
        stop = full[at:at + 3]
        if stop.strip() and full.index(stop) == at:
            return stop, at
    raise AssertionError(f"no usable stop string in {full!r}")


def case_stop(ep, ctx) -> None:
    full = ep.texts(max_tokens=16, ignore_eos=True)[0]
    stop, at = _stop_in(full)
    resp = ep.ok(max_tokens=16, ignore_eos=True, stop=[stop])
    assert ep.text(resp) == full[:at] and resp["choices"][0]["finish_reason"] == "stop"


def case_include_stop_str_in_output(ep, ctx) -> None:
    full = ep.texts(max_tokens=16, ignore_eos=True)[0]
    stop, at = _stop_in(full)
    assert ep.texts(max_tokens=16, ignore_eos=True, stop=stop,
                    include_stop_str_in_output=True) == [full[:at + 3]]


def case_stream(ep, ctx) -> None:
    full = ep.texts(max_tokens=12, ignore_eos=True)[0]
    chunks = ep.stream(max_tokens=12, ignore_eos=True)
    # Server-sent chunks that add up to the whole text, the finish reason on the last one only.
    # How many chunks carry the 12 tokens is not asserted: a stream keeps only the newest
    # output for a reader that falls behind (async_engine.RequestStream), so on a loaded
    # machine the tokens may arrive in one or two chunks.
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"]]
    assert ep.stream_text(chunks) == full and finishes[-1] == "length" \
        and not any(finishes[:-1])
    assert all(ch["object"].endswith("chunk") or ch["object"] == "text_completion"
               for ch in chunks)
    assert ep.ok(stream=False)["object"] in ("text_completion", "chat.completion")


def case_stream_options(ep, ctx) -> None:
    chunks = ep.stream(max_tokens=4, ignore_eos=True, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    ep.refused("stream_options", stream_options={"include_usage": True})  # without stream


def case_user(ep, ctx) -> None:
    tag = f"walker-{random.randrange(10**9)}"
    ep.ok(user=tag)
    assert f"from user {tag}" in ctx["server"].log()  # what OpenAI keeps `user` for


def case_logit_bias(ep, ctx) -> None:
    forced = 37
    resp = ep.ok(logit_bias={str(forced): 100}, ignore_eos=True, max_tokens=5,
                 logprobs=True if ep.chat else 0)
    if ep.chat:
        toks = [e["token"] for e in resp["choices"][0]["logprobs"]["content"]]
    else:
        toks = resp["choices"][0]["logprobs"]["tokens"]
    assert toks == [ctx["tokenizer"].decode([forced], skip_special_tokens=False)] * 5
    ep.refused("logit_bias", logit_bias={"37": 101})
    ep.refused("logit_bias", logit_bias={"not-a-token": 1})
    r = ep.post(logit_bias={str(10**6): 1})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def _eos(ctx) -> str:
    return str(next(iter(ctx["tokenizer"].eos_token_ids)))


def case_ignore_eos(ep, ctx) -> None:
    bias = {_eos(ctx): 100}
    stopped = ep.ok(logit_bias=bias, max_tokens=6)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    going = ep.ok(logit_bias=bias, max_tokens=6, ignore_eos=True)
    assert going["choices"][0]["finish_reason"] == "length"
    assert going["usage"]["completion_tokens"] == 6


def case_min_tokens(ep, ctx) -> None:
    resp = ep.ok(logit_bias={_eos(ctx): 100}, max_tokens=8, min_tokens=3)
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["usage"]["completion_tokens"] == 4  # 3 held back from EOS, then EOS


def case_stop_token_ids(ep, ctx) -> None:
    # the greedy first token, by transformers
    tid = int(_hf_log_softmax(ctx["hf_model"], ctx["prompt_ids"](ep))[-1].argmax())
    resp = ep.ok(stop_token_ids=[tid], ignore_eos=True, max_tokens=8)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == tid
    assert resp["usage"]["completion_tokens"] == 1


def case_skip_special_tokens(ep, ctx) -> None:
    eos_text = ctx["tokenizer"].decode([int(_eos(ctx))], skip_special_tokens=False)
    kw = {"logit_bias": {_eos(ctx): 100}, "ignore_eos": True, "max_tokens": 3}
    assert ep.texts(**kw) == [""]
    assert ep.texts(**kw, skip_special_tokens=False) == [eos_text * 3]


def case_cache_salt(ep, ctx) -> None:
    prompt = _unique_prompt(random.randrange(10**9))
    field = {"messages": [{"role": "user", "content": prompt}]} if ep.chat \
        else {"prompt": prompt}

    def cached(**kw) -> int:
        return ep.ok(max_tokens=1, **field, **kw)["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    # Salts of this call alone: the chat and completions cases both run, and a prompt drawn
    # from ten words can share its first tokens with the other's under a shared salt name (a
    # partial-block hit of a few tokens).
    tag = random.randrange(10**9)
    assert cached(cache_salt=f"tenant-a-{tag}") == 0
    assert cached(cache_salt=f"tenant-a-{tag}") > 32
    assert cached(cache_salt=f"tenant-b-{tag}") == 0


def case_priority(ep, ctx) -> None:
    ep.ok(priority=0)
    ep.refused("priority", priority=3)  # this server evicts by lru: priority would do nothing


def case_prompt_logprobs(ep, ctx) -> None:
    resp = ep.ok(prompt_logprobs=3, max_tokens=1)
    entries = resp["prompt_logprobs"] if ep.chat else resp["choices"][0]["prompt_logprobs"]
    ids = ctx["prompt_ids"](ep)
    ref = _hf_log_softmax(ctx["hf_model"], ids)
    _check_vllm_prompt_logprobs(entries, ids, ref, 3)
    ep.refused("prompt_logprobs", prompt_logprobs=3, stream=True)


def _check_vllm_prompt_logprobs(entries, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = entries[i]
        actual = entry[str(ids[i])]
        assert abs(actual["logprob"] - row[ids[i]].item()) <= TOL
        v = row[ids[i]].item()
        assert int((row > v + TOL).sum()) + 1 <= actual["rank"] <= int((row > v - TOL).sum()) + 1
        values, top = row.topk(k)
        for r, (t, val) in enumerate(zip(top.tolist(), values.tolist()), start=1):
            assert abs(entry[str(t)]["logprob"] - val) <= TOL
            if t != ids[i]:
                assert entry[str(t)]["rank"] == r


def case_response_format(ep, ctx) -> None:
    assert ep.texts(response_format={"type": "text"}) == ep.texts()
    schema = {"type": "object", "properties": {"k": {"enum": ["kernel", "cache"]}},
              "required": ["k"], "additionalProperties": False}
    text = ep.texts(max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "k", "schema": schema, "strict": True}})[0]
    assert json.loads(text)["k"] in ("kernel", "cache")
    ep.refused("response_format", response_format={"type": "json_schema"})


def case_structured_outputs(ep, ctx) -> None:
    # 16 tokens: at temperature 1 the grammar may spell "kernel cache" a character a token
    for text in ep.texts(n=3, temperature=1.0, max_tokens=16, structured_outputs={
            "choice": ["kernel cache", "block"]}):
        assert text in ("kernel cache", "block")
    ep.refused("structured_outputs", structured_outputs={"regex": "(unclosed"})


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"enum": ["kernel", "cache"]}}, "required": ["q"],
    "additionalProperties": False}}}
OTHER_TOOL = {"type": "function", "function": {"name": "other", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def _tool_calls(ep, max_tokens: int = 80, **fields) -> list[dict]:
    return ep.ok(max_tokens=max_tokens, tools=[TOOL, OTHER_TOOL], **fields)["choices"][0][
        "message"].get("tool_calls") or []


def case_tools(ep, ctx) -> None:
    calls = _tool_calls(ep, tool_choice="required", parallel_tool_calls=False)
    assert len(calls) == 1 and calls[0]["function"]["name"] in ("lookup", "other")
    ep.refused("tools", tools=[{"type": "function"}])


def case_parallel_tool_calls(ep, ctx) -> None:
    assert len(_tool_calls(ep, tool_choice="required", parallel_tool_calls=False)) == 1
    several = [len(_tool_calls(ep, max_tokens=300, tool_choice="required", temperature=1.0,
                               seed=s)) for s in range(6)]
    assert max(several) > 1  # allowed by default: a random model writes a second call


def case_functions(ep, ctx) -> None:
    ep.refused("functions", functions=[{"name": "f"}])


def _refused_when_set(value) -> Callable:
    def case(ep, ctx, field: str) -> None:
        ep.refused(field, **{field: value})
    return case


# completions only

def case_prompt(ep, ctx) -> None:
    ids = ctx["tokenizer"].encode(PROMPT)
    assert ep.texts(prompt=ids) == ep.texts(prompt=PROMPT)
    assert ep.texts(prompt=[PROMPT, PROMPT]) == ep.texts(prompt=[ids, ids]) == ep.texts() * 2
    assert ep.texts(prompt="kernel cache") != ep.texts()


def case_max_tokens(ep, ctx) -> None:
    assert ep.ok(max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 5
    if ep.chat:
        ep.refused("max_tokens", max_tokens=0)
        return
    usage = ep.ok(max_tokens=None, ignore_eos=True)["usage"]  # vLLM: up to the context
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512
    ep.refused("max_tokens", max_tokens=0)  # generates nothing: only with echo


def case_logprobs(ep, ctx) -> None:
    if ep.chat:
        resp = ep.ok(logprobs=True)
        assert len(resp["choices"][0]["logprobs"]["content"]) == 8
        assert ep.ok(logprobs=False)["choices"][0]["logprobs"] is None
        return
    lp = ep.ok(logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 8 and all(2 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert ep.ok()["choices"][0]["logprobs"] is None


def case_echo(ep, ctx) -> None:
    resp = ep.ok(echo=True, max_tokens=4, ignore_eos=True)
    assert ep.text(resp) == PROMPT + ep.texts(max_tokens=4, ignore_eos=True)[0]
    assert ep.texts(echo=True, max_tokens=0) == [PROMPT]
    both = ep.ok(echo=True, max_tokens=0, logprobs=1, prompt_logprobs=4)["choices"][0]
    assert all(len(t) <= 2 for t in both["logprobs"]["top_logprobs"][1:])  # logprobs' 1
    assert all(len(e) >= 4 for e in both["prompt_logprobs"][1:])  # prompt_logprobs' 4


def case_suffix(ep, ctx) -> None:
    assert ep.texts(suffix="") == ep.texts()
    ep.refused("suffix", suffix="def f():")


def case_best_of(ep, ctx) -> None:
    assert len(ep.ok(best_of=2, n=2, temperature=1.0, seed=2)["choices"]) == 2
    ep.refused("best_of", best_of=3)


# chat only

def case_messages(ep, ctx) -> None:
    other = ep.ok(messages=[{"role": "user", "content": "kernel cache"}])
    assert other["usage"]["prompt_tokens"] != ep.ok()["usage"]["prompt_tokens"]


def case_max_completion_tokens(ep, ctx) -> None:
    resp = ep.ok(max_completion_tokens=3, max_tokens=7, ignore_eos=True)  # it wins
    assert resp["usage"]["completion_tokens"] == 3


def case_top_logprobs(ep, ctx) -> None:
    content = ep.ok(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 3 for e in content)
    ep.refused("top_logprobs", top_logprobs=3)  # without logprobs


def case_add_generation_prompt(ep, ctx) -> None:
    with_it = ep.ok()["usage"]["prompt_tokens"]
    assert ep.ok(add_generation_prompt=False)["usage"]["prompt_tokens"] < with_it


def case_chat_template_kwargs(ep, ctx) -> None:
    plain = ep.ok()["usage"]["prompt_tokens"]
    marked = ep.ok(chat_template_kwargs={"kvserve_marker": " kernel cache block"})
    assert marked["usage"]["prompt_tokens"] > plain


def case_tool_choice(ep, ctx) -> None:
    assert ep.texts(tool_choice="none") == ep.texts()
    calls = _tool_calls(ep, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [c["function"]["name"] for c in calls] == ["lookup"]
    assert json.loads(calls[0]["function"]["arguments"])["q"] in ("kernel", "cache")
    ep.refused("tool_choice", tool_choice="required")  # without tools


def case_function_call(ep, ctx) -> None:
    ep.refused("function_call", function_call={"name": "f"})


def case_metadata(ep, ctx) -> None:
    """OpenAI's rule: at most 16 pairs, string keys of at most 64 characters, string values
    of at most 512; echoed in the chat.completion object (as OpenAI's stored completions
    return it), and the text is what it is without it."""
    tags = {f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: "tenant-a"}
    resp = ep.ok(metadata=tags)
    assert resp["metadata"] == tags and "metadata" not in ep.ok()
    assert ep.text(resp) == ep.texts()[0]
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513},
                {"k": 1}, ["k", "v"]):
        ep.refused("metadata", metadata=bad)


def case_store(ep, ctx) -> None:
    """Accepted and without effect (the module docstring says why): the same text, and no
    stored completion to fetch (OpenAI's GET /v1/chat/completions/{id} is not served)."""
    resp = ep.ok(store=True)
    assert ep.text(resp) == ep.texts(store=False)[0] == ep.texts()[0]
    got = httpx.get(f"{ctx['server'].url}/v1/chat/completions/{resp['id']}", timeout=30)
    assert got.status_code in (404, 405), got.text
    ep.refused("store", store="yes")


def case_service_tier(ep, ctx) -> None:
    """Every tier OpenAI lists is accepted; the answer (each stream chunk too) names the tier
    that served the request, "default": kvserve has one. Not set, no service_tier."""
    for tier in ("auto", "default", "flex", "scale", "priority", "fast"):
        resp = ep.ok(service_tier=tier)
        assert resp["service_tier"] == "default" and ep.text(resp) == ep.texts()[0], tier
    assert "service_tier" not in ep.ok()
    chunks = ep.stream(max_tokens=3, service_tier="flex",
                       stream_options={"include_usage": True})
    assert chunks and all(ch["service_tier"] == "default" for ch in chunks)
    ep.refused("service_tier", service_tier="turbo")


# nested models

def case_role(ep, ctx) -> None:
    assert ep.texts(messages=[{"role": "system", "content": PROMPT}]) != ep.texts()


def case_content(ep, ctx) -> None:
    parts = [{"type": "text", "text": "alpha bravo"}, {"type": "text", "text": "charlie"}]
    assert ep.texts(messages=[{"role": "user", "content": parts}]) == \
        ep.texts(messages=[{"role": "user", "content": "alpha bravo\ncharlie"}])
    assert ep.texts(messages=[{"role": "user", "content": "kernel"}]) != ep.texts()


def case_name(ep, ctx) -> None:
    named = ep.ok(messages=[{"role": "user", "content": PROMPT, "name": "kernel"}])
    assert named["usage"]["prompt_tokens"] > ep.ok()["usage"]["prompt_tokens"]


def case_tool_calls(ep, ctx) -> None:
    plain = ep.ok(messages=MSGS + [{"role": "assistant", "content": None}])
    called = ep.ok(messages=MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}])
    assert called["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    ep.refused("messages", messages=MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])


def case_tool_call_id(ep, ctx) -> None:
    plain = ep.ok(messages=MSGS + [{"role": "tool", "content": "4"}])
    answered = ep.ok(messages=MSGS + [{"role": "tool", "content": "4",
                                       "tool_call_id": "call_kernel_cache"}])
    assert answered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def case_part_type(ep, ctx) -> None:
    r = ep.post(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}])
    assert r.status_code == 400 and "type" in r.json()["error"]["message"]


def case_part_text(ep, ctx) -> None:
    a = ep.texts(messages=[{"role": "user", "content": [{"type": "text", "text": "kernel"}]}])
    assert a == ep.texts(messages=[{"role": "user", "content": "kernel"}])


def case_include_usage(ep, ctx) -> None:
    without = ep.stream(max_tokens=3, stream_options={"include_usage": False})
    assert all("usage" not in ch for ch in without)
    case_stream_options(ep, ctx)


def case_continuous_usage_stats(ep, ctx) -> None:
    chunks = ep.stream(max_tokens=5, ignore_eos=True,
                       stream_options={"continuous_usage_stats": True})
    usages = [ch["usage"] for ch in chunks]
    assert all(u["prompt_tokens"] == usages[0]["prompt_tokens"] for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def case_kv_cache_report(ep, ctx) -> None:
    assert "kv_cache_report" not in ep.ok(max_tokens=1)
    field = {"messages": [{"role": "user", "content": _unique_prompt(random.randrange(10**9))}]} \
        if ep.chat else {"prompt": _unique_prompt(random.randrange(10**9))}
    first = ep.ok(max_tokens=1, kv_cache_report=True, **field)["kv_cache_report"]
    # a new prompt may share its first tokens (a template's, a BOS) with a cached one
    assert first["first_miss"]["reason"] in ("diverged", "never_seen")
    assert first["first_miss"]["position"] == first["cached_tokens"]
    second = ep.ok(max_tokens=1, kv_cache_report=True, **field)["kv_cache_report"]
    assert second["cached_tokens"] > 0
    assert ep.stream(max_tokens=1, kv_cache_report=True)[-1]["kv_cache_report"]["prompt_tokens"]


def _explain(ctx, **body) -> httpx.Response:
    return httpx.post(ctx["server"].url + "/v1/cache/explain", json=body, timeout=60)


def _explained(ctx, **body) -> dict:
    r = _explain(ctx, **body)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def case_explain_model(ep, ctx) -> None:
    _explained(ctx, model=MODEL, prompt=PROMPT)
    r = _explain(ctx, model="no-such-model", prompt=PROMPT)
    assert r.status_code == 404 and "no-such-model" in r.text


def case_explain_prompt(ep, ctx) -> None:
    text = _unique_prompt(random.randrange(10**9))
    assert _explained(ctx, prompt=text)["cached_tokens"] == 0
    ep.ok(prompt=text, max_tokens=1)
    assert _explained(ctx, prompt=text)["cached_tokens"] > 0
    ids = ctx["tokenizer"].encode(text)
    assert _explained(ctx, prompt=ids)["prompt_tokens"] == len(ids)


def _explain_chat(ctx, **fields) -> dict:
    return _explained(ctx, messages=MSGS, **fields)


def case_explain_messages(ep, ctx) -> None:
    assert _explain_chat(ctx)["prompt_tokens"] == len(ctx["prompt_ids"](Endpoint("", True)))


def case_explain_add_generation_prompt(ep, ctx) -> None:
    assert _explain_chat(ctx, add_generation_prompt=False)["prompt_tokens"] < \
        _explain_chat(ctx)["prompt_tokens"]


def case_explain_chat_template_kwargs(ep, ctx) -> None:
    assert _explain_chat(ctx, chat_template_kwargs={"kvserve_marker": "kernel cache"})[
        "prompt_tokens"] > _explain_chat(ctx)["prompt_tokens"]


def case_explain_tools(ep, ctx) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert _explain_chat(ctx, tools=tools)["prompt_tokens"] >= _explain_chat(ctx)["prompt_tokens"]


def case_explain_cache_salt(ep, ctx) -> None:
    text = _unique_prompt(random.randrange(10**9))
    ep.ok(prompt=text, max_tokens=1, cache_salt="tenant-a")
    assert _explained(ctx, prompt=text, cache_salt="tenant-a")["cached_tokens"] > 0
    assert _explained(ctx, prompt=text, cache_salt="tenant-b")["first_miss"]["reason"] == "salt"


def case_explain_prompt_logprobs(ep, ctx) -> None:
    text = _unique_prompt(random.randrange(10**9))
    ep.ok(prompt=text, max_tokens=1)
    report = _explained(ctx, prompt=text, prompt_logprobs=0)
    assert report["first_miss"]["reason"] == "prompt_logprobs" and report["cached_tokens"] == 0


# retention (their effect under pressure: tests/test_cache_control_server.py)
def case_kv_retention(ep, ctx) -> None:
    ep.ok(max_tokens=1, kv_retention={"priority": 90, "ttl": "10m", "num_tokens": 8})
    ep.refused("kv_retention", kv_retention={"priority": 101})
    ep.refused("kv_retention", kv_retention={"ttl": "soon"})


def case_cache_control(ep, ctx) -> None:
    ep.ok(max_tokens=1, cache_control={"type": "ephemeral", "ttl": "1h"})
    ep.refused("cache_control", cache_control={"type": "ephemeral", "ttl": "2h"})
    ep.refused("cache_control", cache_control={"type": "persistent"})


# disaggregation (honoured end to end: tests/test_disagg_e2e.py, tests/test_kv_transfer.py);
# this server has no kv_transfer_config, so a transfer it cannot do is refused
def case_kv_transfer_params(ep, ctx) -> None:
    assert ep.texts(kv_transfer_params={}) == ep.texts()
    ep.refused("kv_transfer_params", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ep.refused("kv_transfer_params", max_tokens=1, stream=True,
               kv_transfer_params={"do_remote_decode": True})
    ep.refused("kv_transfer_params", max_tokens=1, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1})


def case_message_cache_control(ep, ctx) -> None:
    marked = [{"role": "user", "content": PROMPT, "cache_control": {"type": "ephemeral"}}]
    assert ep.texts(messages=marked) == ep.texts()
    r = ep.post(messages=[dict(marked[0], cache_control={"type": "ephemeral", "ttl": 5})])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].cache_control"


def case_part_cache_control(ep, ctx) -> None:
    part = {"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}}
    assert ep.texts(messages=[{"role": "user", "content": [part]}]) == ep.texts()
    r = ep.post(messages=[{"role": "user", "content": [dict(part, cache_control={"type": "x"})]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].cache_control"


def _pin(ctx, **body) -> httpx.Response:
    return httpx.post(ctx["server"].url + "/v1/cache/pin", json=body, timeout=120)


def _pinned(ctx, **body) -> dict:
    """Pin, check it is listed, unpin (pins hold pool blocks: none outlives its case)."""
    r = _pin(ctx, **body)
    assert r.status_code == 200, r.text[:500]
    pin = r.json()
    url = ctx["server"].url
    assert pin["id"] in [p["id"] for p in httpx.get(url + "/v1/cache/pins").json()["data"]]
    assert httpx.delete(f"{url}/v1/cache/pin/{pin['id']}").status_code == 200
    return pin


def case_pin_model(ep, ctx) -> None:
    _pinned(ctx, model=MODEL, prompt=_unique_prompt(random.randrange(10**9)))
    assert _pin(ctx, model="no-such-model", prompt=PROMPT).status_code == 404


def case_pin_prompt(ep, ctx) -> None:
    text = _unique_prompt(random.randrange(10**9))
    ids = ctx["tokenizer"].encode(text)
    pin = _pinned(ctx, prompt=ids)
    assert pin["num_tokens"] == len(ids) // 16 * 16 and pin["num_blocks"] == len(ids) // 16
    assert _pin(ctx, prompt=[1, 2]).status_code == 400  # under one block


def _long_msgs() -> list[dict]:
    return [{"role": "system", "content": _unique_prompt(random.randrange(10**9))}]


def case_pin_messages(ep, ctx) -> None:
    assert _pinned(ctx, messages=_long_msgs())["num_tokens"] > 0


def case_pin_add_generation_prompt(ep, ctx) -> None:
    msgs = _long_msgs()
    plain, prompted = _pinned(ctx, messages=msgs), _pinned(ctx, messages=msgs,
                                                          add_generation_prompt=True)
    assert plain["num_tokens"] <= prompted["num_tokens"]
    assert _pin(ctx, messages=msgs, add_generation_prompt="yes").status_code == 400


def case_pin_chat_template_kwargs(ep, ctx) -> None:
    msgs = _long_msgs()
    marker = " ".join(["kernel cache block"] * 12)
    assert _pinned(ctx, messages=msgs, chat_template_kwargs={"kvserve_marker": marker})[
        "num_tokens"] > _pinned(ctx, messages=msgs)["num_tokens"]


def case_pin_tools(ep, ctx) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs = _long_msgs()
    assert _pinned(ctx, messages=msgs, tools=tools)["num_tokens"] >= \
        _pinned(ctx, messages=msgs)["num_tokens"]


def case_pin_cache_salt(ep, ctx) -> None:
    text = _unique_prompt(random.randrange(10**9))
    r = _pin(ctx, prompt=text, cache_salt="tenant-pin")
    assert r.status_code == 200, r.text
    url = f"{ctx['server'].url}/v1/cache/pin/{r.json()['id']}"
    try:
        assert _explained(ctx, prompt=text, cache_salt="tenant-pin")["cached_tokens"] >= 16
        # Unsalted, not one whole block of the pin is reachable. (A few tokens may still match
        # inside a first block that another case's prompt, of the same ten words, cached
        # unsalted: a partial-block hit; CI met one of 3 tokens.)
        assert _explained(ctx, prompt=text)["cached_tokens"] < 16
    except AssertionError:
        httpx.delete(url, timeout=30)  # the pin holds pool blocks: none outlives its case
        raise
    assert httpx.delete(url, timeout=30).status_code == 200


# vLLM's names before 0.12 (which removed them): refused with the replacement named
PART_B_REFUSED = {"guided_json": {"type": "object"}, "guided_regex": "a+",
                  "guided_choice": ["a", "b"], "guided_grammar": "root ::= \"a\"",
                  "guided_whitespace_pattern": " ", "guided_decoding_backend": "xgrammar"}

SHARED = {"model": case_model, "n": case_n, "temperature": case_temperature,
          "top_p": case_top_p, "top_k": case_top_k, "min_p": case_min_p,
          "presence_penalty": case_presence_penalty, "frequency_penalty": case_frequency_penalty,
          "repetition_penalty": case_repetition_penalty, "seed": case_seed, "stop": case_stop,
          "include_stop_str_in_output": case_include_stop_str_in_output, "stream": case_stream,
          "stream_options": case_stream_options, "user": case_user,
          "logit_bias": case_logit_bias, "ignore_eos": case_ignore_eos,
          "min_tokens": case_min_tokens, "stop_token_ids": case_stop_token_ids,
          "skip_special_tokens": case_skip_special_tokens, "cache_salt": case_cache_salt,
          "priority": case_priority, "prompt_logprobs": case_prompt_logprobs,
          "response_format": case_response_format, "max_tokens": case_max_tokens,
          "structured_outputs": case_structured_outputs,
          "logprobs": case_logprobs, "kv_cache_report": case_kv_cache_report,
          "kv_retention": case_kv_retention, "cache_control": case_cache_control,
          "kv_transfer_params": case_kv_transfer_params}
CASES: dict[tuple[str, str], Callable] = {}
for _name in ("CompletionRequest", "ChatCompletionRequest"):
    CASES.update({(_name, f): c for f, c in SHARED.items()})
    CASES.update({(_name, f): _refused_when_set(v) for f, v in PART_B_REFUSED.items()
                  if f in getattr(protocol, _name).model_fields})
CASES.update({("CompletionRequest", f): c for f, c in {
    "prompt": case_prompt, "echo": case_echo, "suffix": case_suffix,
    "best_of": case_best_of}.items()})
CASES.update({("ChatCompletionRequest", f): c for f, c in {
    "messages": case_messages, "max_completion_tokens": case_max_completion_tokens,
    "top_logprobs": case_top_logprobs, "add_generation_prompt": case_add_generation_prompt,
    "chat_template_kwargs": case_chat_template_kwargs, "tool_choice": case_tool_choice,
    "function_call": case_function_call, "tools": case_tools,
    "parallel_tool_calls": case_parallel_tool_calls, "functions": case_functions,
    "metadata": case_metadata, "store": case_store,
    "service_tier": case_service_tier}.items()})
CASES.update({("ChatMessage", "role"): case_role, ("ChatMessage", "content"): case_content,
              ("ChatMessage", "name"): case_name, ("ChatMessage", "tool_calls"): case_tool_calls,
              ("ChatMessage", "tool_call_id"): case_tool_call_id,
              ("ChatMessage", "cache_control"): case_message_cache_control,
              ("TextPart", "type"): case_part_type, ("TextPart", "text"): case_part_text,
              ("TextPart", "cache_control"): case_part_cache_control,
              ("StreamOptions", "include_usage"): case_include_usage,
              ("StreamOptions", "continuous_usage_stats"): case_continuous_usage_stats})
CASES.update({("CacheExplainRequest", f): c for f, c in {
    "model": case_explain_model, "prompt": case_explain_prompt,
    "messages": case_explain_messages,
    "add_generation_prompt": case_explain_add_generation_prompt,
    "chat_template_kwargs": case_explain_chat_template_kwargs, "tools": case_explain_tools,
    "cache_salt": case_explain_cache_salt,
    "prompt_logprobs": case_explain_prompt_logprobs}.items()})
CASES.update({("CachePinRequest", f): c for f, c in {
    "model": case_pin_model, "prompt": case_pin_prompt, "messages": case_pin_messages,
    "add_generation_prompt": case_pin_add_generation_prompt,
    "chat_template_kwargs": case_pin_chat_template_kwargs, "tools": case_pin_tools,
    "cache_salt": case_pin_cache_salt}.items()})
# which endpoint a nested model's case runs on
_NESTED_ENDPOINT = {"ChatMessage": "chat", "TextPart": "chat", "StreamOptions": "both"}


def request_models() -> list[type[BaseModel]]:
    """Every public pydantic model protocol.py defines: the request bodies and their parts."""
    return [m for m in vars(protocol).values()
            if isinstance(m, type) and issubclass(m, BaseModel) and m is not BaseModel
            and m.__module__ == protocol.__name__ and not m.__name__.startswith("_")]


def all_fields() -> list[tuple[str, str]]:
    return sorted((m.__name__, f) for m in request_models() for f in m.model_fields)


def test_every_field_has_a_case():
    missing = [f"{m}.{f}" for m, f in all_fields() if (m, f) not in CASES]
    assert not missing, f"fields with no case (honour them or refuse them): {missing}"
    stale = sorted(set(CASES) - set(all_fields()))
    assert not stale, f"cases for fields protocol.py no longer has: {stale}"


@pytest.fixture(scope="module")
def ctx(server, tokenizer, hf_model, comp, chat):
    def prompt_ids(ep: Endpoint) -> list[int]:
        if not ep.chat:
            return tokenizer.encode(PROMPT)
        text = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
        return tokenizer.encode(text, False)

    return {"server": server, "tokenizer": tokenizer, "hf_model": hf_model,
            "prompt_ids": prompt_ids}


@pytest.mark.parametrize("model_name,field", all_fields(),
                         ids=[f"{m}.{f}" for m, f in all_fields()])
def test_field_is_honoured_or_refused(model_name, field, comp, chat, ctx):
    case = CASES.get((model_name, field))
    if case is None:
        pytest.fail(f"{model_name}.{field} has no case")
    where = _NESTED_ENDPOINT.get(model_name)
    endpoints = {"chat": [chat], "both": [comp, chat], None: [chat if "Chat" in model_name
                                                               else comp]}[where]
    for ep in endpoints:
        if field in PART_B_REFUSED and model_name.endswith("Request"):
            case(ep, ctx, field)
        else:
            case(ep, ctx)


# ------------------------------------------------------------------------------------------
# null is the default; unknown fields are refused
# ------------------------------------------------------------------------------------------

REQUIRED = {"prompt", "messages"}


@pytest.mark.parametrize("model_name", ["CompletionRequest", "ChatCompletionRequest"])
def test_null_is_the_default_in_every_optional_field(model_name, comp, chat):
    """Each optional field sent as JSON null gives exactly the response without it (greedy,
    so the text is comparable); completions' max_tokens null is vLLM's "up to the context",
    shown in case_max_tokens."""
    ep = chat if model_name.startswith("Chat") else comp
    model = getattr(protocol, model_name)
    common = {"max_tokens": 6, "ignore_eos": True, "seed": 5}
    for field in model.model_fields:
        if field in REQUIRED or (field == "max_tokens" and not ep.chat):
            continue
        fields = {k: v for k, v in common.items() if k != field}
        if field == "max_tokens":  # chat: both mean up to the context
            assert ep.ok(**fields, max_tokens=None)["usage"] == \
                ep.ok(**fields, max_tokens=DROP)["usage"]
            continue
        # temperature null is OpenAI's default 1 (seeded here), not the body's 0
        assert ep.texts(**fields, **{field: None}) == ep.texts(**fields, **{field: DROP}), field
    r = ep.ok(n=None, stream=None, logprobs=None, stream_options=None)
    assert len(r["choices"]) == 1 and r["choices"][0]["logprobs"] is None
    chunks = ep.stream(max_tokens=3, stream_options={"include_usage": None,
                                                     "continuous_usage_stats": None})
    assert all("usage" not in ch for ch in chunks)
    if ep.chat:
        assert ep.texts(messages=[{"role": "user", "content": PROMPT, "name": None}]) == \
            ep.texts()


def test_unknown_fields_are_refused_and_named(comp, chat):
    """OpenAI refuses an unrecognised argument; vLLM ignores it with a warning. kvserve does
    what OpenAI does, so a misspelt or unsupported option is never silently dropped: a name
    OpenAI does not have on that endpoint (vLLM's beam search, a misspelling, chat's `store`
    sent to completions, where OpenAI has no stored completions) is a 400 naming it."""
    for ep, body in ((comp, {"use_beam_search": True}), (chat, {"temprature": 0.5}),
                     (comp, {"store": True}), (comp, {"service_tier": "auto"}),
                     (comp, {"metadata": {"k": "v"}}),
                     (comp, {"stream": True, "stream_options": {"include_usage": True,
                                                               "chunk": 1}}),
                     (chat, {"messages": [{"role": "user", "content": "x", "weight": 2}]})):
        r = ep.post(**body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        name = next(k for k in ("use_beam_search", "temprature", "store", "service_tier",
                                "metadata", "chunk", "weight") if k in json.dumps(body))
        assert name in err["message"] and "unknown field" in err["message"], err


# ------------------------------------------------------------------------------------------
# echo and prompt logprobs against transformers
# ------------------------------------------------------------------------------------------

def _check_echo_logprobs(lp: dict, prompt: list[int], ref: torch.Tensor, k: int,
                         tokenizer, generated: int) -> None:
    n = len(prompt)
    assert len(lp["tokens"]) == n + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        row = ref[i - 1]
        assert abs(lp["token_logprobs"][i] - row[prompt[i]].item()) <= TOL
        top = lp["top_logprobs"][i]
        values, ids = row.topk(k)
        assert len(top) in (k, k + 1)  # the top k, and the actual token if not among them
        got = sorted(top.values(), reverse=True)[:k]
        assert max(abs(a - b) for a, b in zip(got, values.tolist())) <= TOL
        for t, v in zip(ids.tolist(), values.tolist()):
            name = tokenizer.decode([t], skip_special_tokens=False)
            if "\ufffd" not in name:  # part of a character: named "bytes:\xNN" instead
                assert abs(top[name] - v) <= TOL
    for i in range(n - 1):
        assert lp["text_offset"][i + 1] - lp["text_offset"][i] == \
            len(tokenizer.decode([prompt[i]], skip_special_tokens=False))


def test_echo_with_logprobs_matches_transformers(comp, tokenizer, hf_model):
    """lm-eval's loglikelihood request: batched token-id prompts, echo, logprobs 1 and 3,
    max_tokens 1 and 0; the prompt's logprobs are transformers' log_softmax of the same ids."""
    prompts = [tokenizer.encode(_unique_prompt(s, 12 + 9 * s)) for s in range(3)]
    refs = [_hf_log_softmax(hf_model, p) for p in prompts]
    for max_tokens, k in ((1, 1), (0, 3)):
        resp = comp.ok(prompt=prompts, echo=True, logprobs=k, max_tokens=max_tokens)
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        assert resp["usage"]["completion_tokens"] == max_tokens * len(prompts)
        for choice, p, ref in zip(choices, prompts, refs):
            _check_echo_logprobs(choice["logprobs"], p, ref, k, tokenizer, max_tokens)
            assert choice["text"].startswith(tokenizer.decode(p))
            assert choice["finish_reason"] == "length"
            if max_tokens:  # the generated token is the greedy one, after the prompt's
                last = choice["logprobs"]["tokens"][-1]
                greedy = int(_hf_log_softmax(hf_model, p)[-1].argmax())
                assert last == tokenizer.decode([greedy], skip_special_tokens=False)


def test_echo_text_only_n_and_special_tokens(comp, tokenizer):
    """Without logprobs echo costs nothing extra (the prefix cache is still read); with n > 1
    every choice carries the prompt; a token-id prompt is decoded as the completion is."""
    prompt = _unique_prompt(99)
    comp.ok(prompt=prompt, max_tokens=1)
    resp = comp.ok(prompt=prompt, echo=True, max_tokens=3, n=2, temperature=1.0, seed=5)
    assert all(c["text"].startswith(prompt) and c["logprobs"] is None for c in resp["choices"])
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    eos = next(iter(tokenizer.eos_token_ids))
    ids = tokenizer.encode("alpha") + [eos]
    assert comp.texts(prompt=ids, echo=True, max_tokens=0) == ["alpha"]
    assert comp.texts(prompt=ids, echo=True, max_tokens=0, skip_special_tokens=False) == \
        ["alpha" + tokenizer.decode([eos], skip_special_tokens=False)]


def test_streamed_echo_equals_the_non_streamed_one(comp):
    for kw in ({"logprobs": 2, "max_tokens": 5}, {"max_tokens": 0, "logprobs": 1},
               {"max_tokens": 4}, {"n": 2, "logprobs": 1, "max_tokens": 3}):
        whole = comp.ok(echo=True, ignore_eos=True, **kw)
        chunks = comp.stream(echo=True, ignore_eos=True, **kw)
        for choice in whole["choices"]:
            mine = [c for ch in chunks for c in ch["choices"] if c["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[-1]["finish_reason"] == choice["finish_reason"]
            if choice["logprobs"] is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    assert [x for c in mine for x in c["logprobs"][key]] == \
                        choice["logprobs"][key], key


def test_prefill_only_requests_leave_no_blocks(comp, server):
    """Many echo + max_tokens 0 requests, some aborted by the client mid-way: the pool is
    empty afterwards (kvserve:kv_cache_usage_perc back to 0)."""
    import asyncio

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            jobs = [client.post(comp.url, json=comp.body(
                prompt=_unique_prompt(1000 + i, 40), echo=True, logprobs=1, max_tokens=0))
                for i in range(12)]
            results = await asyncio.gather(*jobs)
            assert all(r.status_code == 200 for r in results)
            for i in range(4):  # clients that may go away before the answer
                try:
                    await asyncio.wait_for(client.post(comp.url, json=comp.body(
                        prompt=_unique_prompt(2000 + i, 300), echo=True, logprobs=5,
                        max_tokens=0)), 0.02 * (i + 1))
                except asyncio.TimeoutError:
                    pass

    asyncio.run(run())
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        usage = [ln for ln in text.splitlines() if ln.startswith("kvserve:kv_cache_usage_perc")]
        running = [ln for ln in text.splitlines() if ln.startswith("kvserve:num_requests_running")]
        if usage and float(usage[0].split()[-1]) == 0.0 and float(running[0].split()[-1]) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks still held: {usage} {running}")


def test_the_openai_client_with_echo_none_arguments_and_retrieve(server, tokenizer, hf_model):
    """The official SDK: arguments passed as None go out as null, echo's null first entry
    and max_tokens 0 parse, models.retrieve works (and 404s as NotFoundError)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1,
                                    max_tokens=0, n=None, stream=None, best_of=None,
                                    temperature=None, seed=None, stop=None, user=None)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_log_softmax(hf_model, ids)
    assert max(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item())
               for i in range(1, len(ids))) <= TOL
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, n=None,
                                          logprobs=None, stream=None, temperature=0,
                                          top_logprobs=None, tool_choice=None,
                                          response_format=None)
    assert chat.choices[0].message.content is not None
