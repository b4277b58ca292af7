"""Structured outputs and tool calls through the clients users point at kvserve: the official
`openai` SDK and LangChain's `ChatOpenAI`, against a real `kvserve serve` process on the tiny
random-weight model. Whatever the weights say, the grammar must make the output valid: every
result is checked with `jsonschema` (an independent validator) against the schema it was asked
for, over 50 seeded random schemas (nested objects, arrays, enums, bounded numbers, required
fields; strings and arrays bounded so that a random model's output ends within max_tokens)."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from test_server import ServerProcess

from kvserve.model_loader.make_model import ensure_default_model

pytestmark = pytest.mark.timeout(900)

NUM_SCHEMAS = 50
MAX_TOKENS = 400  # above the longest output the bounded schemas allow


# ------------------------------------------------------------------------------------------
# random schemas
# ------------------------------------------------------------------------------------------

def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties of random kinds; every size is bounded."""
    props = {}
    for i in range(rng.randint(1, 4)):
        props[f"{rng.choice(['id', 'name', 'size', 'tag', 'kind', 'pos'])}_{i}"] = \
            random_value_schema(rng, depth)
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def random_value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "number", "string", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.randint(-50, 50)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x y", "z\"q"],
                                   rng.randint(1, 4))}
    if kind == "object":
        return random_schema(rng, depth + 1)
    return {"type": "array", "items": random_value_schema(rng, depth + 1),
            "minItems": 0, "maxItems": rng.randint(1, 3)}


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(NUM_SCHEMAS)]
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess("structured", [str(ensure_default_model()), "--served-model-name",
                                        "tiny", "--max-num-seqs", "64",
                                        "--max-model-len", "2048"],
                         tmp_path_factory.mktemp("structured-logs"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() is None, proc.log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _parallel(fn, items):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:  # concurrent requests share the engine's batches
        return list(pool.map(fn, items))


# ------------------------------------------------------------------------------------------
# the openai SDK
# ------------------------------------------------------------------------------------------

def test_response_format_json_schema_validates_for_50_schemas(client):
    def ask(item):
        i, schema = item
        resp = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}})
        return schema, resp.choices[0]

    for schema, choice in _parallel(ask, enumerate(SCHEMAS)):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_structured_outputs_fields_on_completions(client):
    schema = SCHEMAS[0]
    resp = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS,
                                     extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(resp.choices[0].text), schema)
    resp = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, n=4,
                                     extra_body={"structured_outputs": {
                                         "choice": ["alpha", "beta", "gamma delta"]}})
    assert {c.text for c in resp.choices} <= {"alpha", "beta", "gamma delta"}
    resp = client.completions.create(model="tiny", prompt="Mail:", max_tokens=40,
                                     extra_body={"structured_outputs": {
                                         "regex": r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)"}})
    assert __import__("re").fullmatch(r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)",
                                      resp.choices[0].text)
    resp = client.completions.create(
        model="tiny", prompt="Yes or no:", max_tokens=10,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}})
    assert resp.choices[0].text in ("yes", "no", "maybe")


def test_bad_grammars_are_400_with_the_reason(client):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {
                  "name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
             ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "parenthesis"),
             ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "grammar"),
             ({"extra_body": {"guided_json": {"type": "object"}}}, "structured_outputs"),
             ({"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}}, "exactly one"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
              "schema")]
    for kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                           **kwargs)
        assert needle in err.value.body["message"], (kwargs, err.value.body)


def test_named_and_required_tool_choice_give_parsable_calls(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        for seed in range(3):
            resp = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
                max_tokens=MAX_TOKENS, seed=seed)
            c = resp.choices[0]
            # OpenAI's and vLLM's finish_reason: "stop" for a named choice, "tool_calls" else
            assert c.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
            assert len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            assert call.id.startswith("call_") and call.type == "function"
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """delta.tool_calls assembled as a client does, the last finish_reason, and the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None  # the id comes once, in the first chunk
                    entry["id"] = tc.id
                    assert tc.function.name and tc.type == "function"
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_streamed_tool_calls_assemble_to_the_same_shape(client, choice):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME],
        tool_choice=choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS, seed=1,
        stream=True)
    calls, finish, content = _streamed_calls(stream)
    assert finish == ("tool_calls" if choice == "required" else "stop")
    assert list(calls) == [0] and content == ""
    assert calls[0]["id"].startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0]["name"]]
    assert choice == "required" or tool is WEATHER
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_a_named_tool_choice_writes_only_its_compact_arguments(client):
    """The grammar holds a named choice's output to the arguments alone, without the chat
    template's wrapper and without loose whitespace: the arguments are exactly what
    `json.dumps` writes for their value (the stdlib as the independent serializer)."""
    for seed in range(4):
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER, TIME], tool_choice=NAMED_WEATHER, max_tokens=64, seed=seed,
            temperature=1.0)
        c = resp.choices[0]
        assert c.finish_reason == "stop" and c.message.content is None
        args = c.message.tool_calls[0].function.arguments
        assert args == json.dumps(json.loads(args), ensure_ascii=False), args
        jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_a_tool_call_cut_by_max_tokens_is_still_a_call(client, stream, choice):
    """max_tokens too small for the arguments: finish_reason "length", and the call is still
    there, its arguments the text written so far (here a JSON prefix, not yet a document)."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER], tool_choice=choice, max_tokens=6, seed=0, temperature=1.0)
    if stream:
        calls, finish, content = _streamed_calls(
            client.chat.completions.create(stream=True, **kwargs))
        assert content == "" and list(calls) == [0]
        call = calls[0]
    else:
        c = client.chat.completions.create(**kwargs).choices[0]
        finish, (tc,) = c.finish_reason, c.message.tool_calls
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert finish == "length"
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    if choice != "required":  # (required spends some of its 6 tokens on the call's own JSON)
        assert call["arguments"].startswith("{")
    with pytest.raises(ValueError):
        json.loads(call["arguments"])


def test_two_turn_tool_conversation_round_trips_through_the_template(client, server):
    from kvserve.tokenizer.tokenizer import Tokenizer

    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=MAX_TOKENS)
    call = first.choices[0].message.tool_calls[0]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8, temperature=0)
    # The prompt the server built is the template's rendering of the history, calls included.
    tok = Tokenizer.from_dir(ensure_default_model())
    expected = tok.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call.function.name,
                                              "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": "12 C, rain"}], tools=[WEATHER])
    assert second.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    assert "<tool_call>" in expected and '"name": "get_weather"' in expected
    assert "<tool_response>\n12 C, rain\n</tool_response>" in expected
    assert second.choices[0].message.tool_calls is None


def test_legacy_functions_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       functions=[WEATHER["function"]])
    assert "tools" in err.value.body["message"] and err.value.body["param"] == "functions"


# ------------------------------------------------------------------------------------------
# LangChain
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    def ask(item):
        i, schema = item
        # seeded per schema, as the SDK test above, so that a failure reproduces
        llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused",
                         max_tokens=MAX_TOKENS, max_retries=0, timeout=300, seed=i)
        named = {"title": f"Thing{i}", "description": "a thing", **schema}
        return schema, llm.with_structured_output(named, method=method, strict=True).invoke(
            "Describe a thing.")

    for schema, result in _parallel(ask, enumerate(SCHEMAS)):
        jsonschema.validate(result, schema)


PERSON = {"title": "Person", "description": "a person", "type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


def test_langchain_function_calling_within_64_tokens(server):
    """The report this answers: `with_structured_output(method="function_calling")` with 64
    tokens got finish_reason "length" and the Hermes wrapper as content, no tool_calls. Now
    64 tokens hold the arguments, which LangChain parses from tool_calls; and with too few
    tokens the response is still a call (finish_reason "length"), which LangChain reports as
    an invalid tool call of that name rather than as text."""
    from langchain_openai import ChatOpenAI

    def llm(max_tokens: int, seed: int):
        return ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused",
                          max_tokens=max_tokens, max_retries=0, timeout=300, seed=seed,
                          temperature=1.0)

    for seed in range(4):
        result = llm(64, seed).with_structured_output(
            PERSON, method="function_calling").invoke("Describe a person.")
        jsonschema.validate(result, PERSON)
    cut = llm(5, 0).with_structured_output(PERSON, method="function_calling",
                                           include_raw=True).invoke("Describe a person.")
    raw = cut["raw"]
    assert raw.response_metadata["finish_reason"] == "length"
    assert [c["name"] for c in raw.tool_calls + raw.invalid_tool_calls] == ["Person"]


def test_langchain_json_mode_returns_a_json_object(server):
    """json_mode sends no schema (only {"type": "json_object"}), so no server can make the
    output follow one; what it guarantees is a JSON object, which LangChain parses."""
    from langchain_openai import ChatOpenAI

    # Any JSON object is unbounded, so a random-weight model needs room (and a seed whose
    # draw closes its strings in time: greedy may repeat one string token forever).
    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused",
                     max_tokens=1900, max_retries=0, timeout=300, temperature=1.0, seed=1)
    schema = {"title": "Empty", "description": "anything", "type": "object"}
    result = llm.with_structured_output(schema, method="json_mode").invoke("JSON please.")
    jsonschema.validate(result, schema)


def _forced_text_regex(text: str) -> str:
    """A regex matching exactly `text` (so that `auto` mode can be driven to write a call)."""
    return "".join("\\" + ch if ch in "\\.^$*+?{}[]|()/" else ch for ch in text)


TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tool_choice_parses_calls_streamed_and_not(client, parallel):
    """`auto` leaves the model free; a regex makes this one write two calls after some text,
    which both forms of the response must turn into content + tool_calls."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Time and weather?"}],
                  tools=[WEATHER, TIME], tool_choice="auto", max_tokens=200,
                  parallel_tool_calls=parallel,
                  extra_body={"structured_outputs": {"regex": _forced_text_regex(TWO_CALLS)}})
    expected = [("get_time", {"zone": 3}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    expected = expected if parallel else expected[:1]
    msg = client.chat.completions.create(**kwargs).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in msg.message.tool_calls] == expected
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content.strip() == "Checking."
    assert [(calls[k][0], json.loads(calls[k][1])) for k in sorted(calls)] == expected


def test_response_format_on_completions_and_n(client):
    schema = SCHEMAS[1]
    resp = client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, n=3, seed=5, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert len(resp.choices) == 3
    for c in resp.choices:
        jsonschema.validate(json.loads(c.text), schema)
