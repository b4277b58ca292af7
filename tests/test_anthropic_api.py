"""Issue 53, part 2: Anthropic's Messages API through the official `anthropic` SDK (2.x) against a
real `kvserve serve` process (the tiny random-weight model, an API key, as a deployment has).

Each case checks what the SDK sees against what the same request means on the chat endpoint
(kvserve's own, tested against transformers elsewhere): the same greedy text, the same prompt
length, the same tool call; and the cache figures against the pool's block size. Cases: text,
system as a string / as blocks / as 2.x system messages, stop sequences, sampling through
extra_body, metadata, tools (any, named, none, a round trip with tool_result, streamed
input_json_delta), streaming (text_stream, the raw event order, the final message), errors in
Anthropic's shape (unknown model, missing max_tokens, an image, extended thinking, an unknown
field, a bad TTL), auth (x-api-key, bearer, a wrong key), count_tokens, cache breakpoints (on a
system block, at the top, with their TTLs, max_tokens 0 to fill the cache), the extensions
cache_salt and kv_cache_report, and output_config's JSON schema.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from server_process import ServerProcess

from kvserve.model_loader.make_model import ensure_default_model

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
KEY = "sk-ant-kvserve-test"
BLOCK = 16
SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the page." for i in range(30))
# Bounded inputs: the random-weight model fills a free string until max_tokens.
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
               "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("anthropic", [str(ensure_default_model()), "--served-model-name", MODEL,
                                      "--api-key", KEY, "--max-num-seqs", "8",
                                      "--block-size", str(BLOCK), "--disable-log-stats"],
                        tmp_path_factory.mktemp("anthropic-logs"), max_model_len=2048)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def ask(client, text: str = "Say something.", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("extra_body", {"temperature": 0.0})  # greedy, so that answers compare
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                  **kw)


def chat(server, messages, **fields) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": messages, "temperature": 0.0, **fields})
    assert r.status_code == 200, r.text[:300]
    return r.json()


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def count(client, **kw) -> int:
    kw.setdefault("messages", [{"role": "user", "content": "Say something."}])
    return client.messages.count_tokens(model=MODEL, **kw).input_tokens


# -- text -------------------------------------------------------------------------------------

def test_text_equals_the_chat_endpoints_greedy_answer(client, server):
    msg = ask(client, max_tokens=12)
    want = chat(server, [{"role": "user", "content": "Say something."}], max_tokens=12)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert text_of(msg) == want["choices"][0]["message"]["content"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    u = msg.usage
    assert u.output_tokens == want["usage"]["completion_tokens"]
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == \
        want["usage"]["prompt_tokens"]


def test_max_tokens_is_the_stop_reason_when_reached(client):
    msg = ask(client, "Count to a thousand.", max_tokens=3)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_system_as_string_blocks_and_messages_are_one_prompt(client):
    plain = count(client)
    as_str = count(client, system="You are terse.")
    blocks = count(client, system=[{"type": "text", "text": "You are terse."}])
    as_msg = count(client, messages=[{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Say something."}])
    assert as_str == blocks == as_msg > plain
    a = ask(client, system="You are terse.")
    b = ask(client, system=[{"type": "text", "text": "You are terse."}])
    assert text_of(a) == text_of(b)


def test_stop_sequences(client):
    full = text_of(ask(client, "Tell me a story.", max_tokens=24))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    msg = ask(client, "Tell me a story.", max_tokens=24, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert text_of(msg) == full[:full.index(stop)]


def test_sampling_fields_through_extra_body_and_metadata(client):
    def sample(seed_text):
        return client.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": seed_text}],
            metadata={"user_id": "user-123"},
            extra_body={"temperature": 0.0, "top_p": 0.5, "top_k": 5})
    assert text_of(sample("Hello")) == text_of(sample("Hello"))
    with pytest.raises(anthropic.BadRequestError):  # Anthropic's range: at most 1
        client.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "hi"}])


# -- tools ------------------------------------------------------------------------------------

def test_tool_choice_any_gives_a_tool_use_with_valid_input(client):
    msg = ask(client, "Weather in Paris?", max_tokens=64, tools=[WEATHER],
              tool_choice={"type": "any"})
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome", "Oslo")
    assert msg.stop_reason == "tool_use" and use.id


def test_named_tool_choice_and_none(client):
    other = {"name": "get_time", "input_schema": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}
    msg = ask(client, "Time?", max_tokens=64, tools=[WEATHER, other],
              tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_time"]
    assert msg.stop_reason == "tool_use"
    none = ask(client, "Time?", max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"})
    assert all(b.type == "text" for b in none.content)


def test_a_tool_use_round_trip(client, server):
    first = ask(client, "Weather in Paris?", max_tokens=64, tools=[WEATHER],
                tool_choice={"type": "any"})
    use = next(b for b in first.content if b.type == "tool_use")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 21 degrees."}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=history,
                                    tools=[WEATHER], extra_body={"temperature": 0.0})
    openai_history = [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [{
                          "id": use.id, "type": "function", "function": {
                              "name": use.name, "arguments": json.dumps(use.input)}}]},
                      {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 degrees."}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description":
                                               WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    want = chat(server, openai_history, tools=tools, max_tokens=8)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens + \
        second.usage.cache_creation_input_tokens
    assert total == want["usage"]["prompt_tokens"]
    assert count(client, messages=history, tools=[WEATHER]) == total
    failed = [dict(history[2]["content"][0], is_error=True)]
    assert count(client, messages=history[:2] + [{"role": "user", "content": failed}],
                 tools=[WEATHER]) > total  # the model is told of the error


def test_streamed_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=64, tools=[WEATHER],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]
                                ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert isinstance(use.input, dict) and "city" in use.input
    assert "input_json" in kinds and final.stop_reason == "tool_use"


# -- streaming --------------------------------------------------------------------------------

def test_stream_text_equals_the_answer(client):
    whole = ask(client, "Tell me a story.", max_tokens=16)
    with client.messages.stream(model=MODEL, max_tokens=16, extra_body={"temperature": 0.0},
                                messages=[{"role": "user", "content": "Tell me a story."}]
                                ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(whole) == text_of(final)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == whole.stop_reason


def test_the_raw_event_sequence(client):
    events = list(client.messages.create(
        model=MODEL, max_tokens=6, stream=True, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": "Hi"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    assert events[-2].usage.output_tokens == 6
    r = httpx.post(f"{str(client.base_url).rstrip('/')}/v1/messages", headers={"x-api-key": KEY},
                   timeout=60,
                   json={"model": MODEL, "max_tokens": 2, "stream": True,
                         "messages": [{"role": "user", "content": "Hi"}]})
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"], names


# -- errors and auth --------------------------------------------------------------------------

def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.message


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}
BAD_REQUESTS = {  # what is changed in a valid body -> a word the message must hold
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "an image": ({"messages": [{"role": "user", "content": [IMAGE]}]}, "image"),
    "extended thinking": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "an unknown field": ({"container": "x"}, "container"),
    "a TTL Anthropic has not": ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "ttl"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                      "web_search"),
    "effort": ({"output_config": {"effort": "high"}}, "effort"),
    "a tool_result in an assistant turn": (
        {"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "tool_result"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_400s_in_anthropics_shape(server, case):
    change, word = BAD_REQUESTS[case]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, json=body)
    assert word in _anthropic_error(r, 400, "invalid_request_error")


def test_auth_by_x_api_key_or_bearer(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
    _anthropic_error(httpx.post(f"{server.url}/v1/messages", json={}), 401,
                     "authentication_error")
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}]).usage.output_tokens >= 1


# -- the cache ----------------------------------------------------------------------------------

def test_a_system_breakpoint_creates_then_reads(client):
    system = [{"type": "text", "text": "Breakpoint one. " + SYSTEM,
               "cache_control": {"type": "ephemeral"}}]
    first = ask(client, "Question one?", system=system, max_tokens=2)
    second = ask(client, "Question two, longer?", system=system, max_tokens=2)
    # only the chat template's first tokens were cached before (a partial-block hit)
    assert first.usage.cache_read_input_tokens < BLOCK
    assert first.usage.cache_creation_input_tokens > 100
    assert (first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens) \
        % BLOCK == 0  # whole blocks are what the cache keeps
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    total = count(client, system=system, messages=[{"role": "user",
                                                     "content": "Question two, longer?"}])
    u = second.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == total


def test_automatic_caching_and_ttls(client):
    system = "Automatic caching. " + SYSTEM
    first = ask(client, "One?", system=system, max_tokens=2,
                cache_control={"type": "ephemeral", "ttl": "1h"})
    assert first.usage.cache_creation_input_tokens > 100
    second = ask(client, "One?", system=system, max_tokens=2,
                 cache_control={"type": "ephemeral"})
    assert second.usage.cache_read_input_tokens > 100
    plain = ask(client, "One?", system="No breakpoint. " + SYSTEM, max_tokens=2)
    assert plain.usage.cache_creation_input_tokens == 0  # as at Anthropic: none asked


def test_max_tokens_zero_fills_the_cache(client):
    system = [{"type": "text", "text": "Pre-warmed. " + SYSTEM,
               "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    warm = ask(client, "Later question?", system=system, max_tokens=0)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0 and warm.usage.cache_creation_input_tokens > 100
    hit = ask(client, "Later question?", system=system, max_tokens=2)
    assert hit.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens


def test_cache_salt_and_the_cache_report_extensions(client):
    system = "Salted. " + SYSTEM
    a = ask(client, "Q?", system=system, max_tokens=2,
            extra_body={"temperature": 0.0, "cache_salt": "tenant-a", "kv_cache_report": True})
    b = ask(client, "Q?", system=system, max_tokens=2,
            extra_body={"temperature": 0.0, "cache_salt": "tenant-b", "kv_cache_report": True})
    a2 = ask(client, "Q?", system=system, max_tokens=2,
             extra_body={"temperature": 0.0, "cache_salt": "tenant-a", "kv_cache_report": True})
    assert b.usage.cache_read_input_tokens == 0 and a2.usage.cache_read_input_tokens > 100
    report = a2.model_extra["kv_cache_report"]
    assert report["cached_tokens"] == a2.usage.cache_read_input_tokens
    assert a.model_extra["kv_cache_report"]["first_miss"]["reason"] in (
        "never_seen", "partial_block")


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}
    msg = client.messages.create(model=MODEL, max_tokens=48,
                                 messages=[{"role": "user", "content": "Answer in JSON."}],
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}})
    if msg.stop_reason != "max_tokens":
        assert isinstance(json.loads(text_of(msg))["answer"], str)
    else:  # cut short: still the schema's prefix
        assert text_of(msg).startswith('{"answer"') or text_of(msg).startswith("{")
