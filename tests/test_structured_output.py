"""Structured outputs in the engine and the sampler, and the tool-call parser.

The sampler's masking is checked against a plain-PyTorch reference (softmax of the logits with
the forbidden tokens at -inf); the engine's outputs against independent validators (jsonschema,
Python's `re`), through batching with unconstrained neighbours, n > 1 and preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import kv_bytes_per_token

from kvserve import LLM, SamplingParams
from kvserve.model_loader.make_model import ensure_default_model
from kvserve.sampler import Sampler, SamplingRow
from kvserve.structured.bitmask import apply_bitmask
from kvserve.server.tool_parser import ForcedToolCalls, ToolCallStream, assemble, parse_tool_calls
from kvserve.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "s": {"type": "string", "maxLength": 5},
    "e": {"enum": ["a", "b c"]},
    "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["n", "s", "e"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(ensure_default_model()), max_model_len=512, seed=0)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> int32 [rows, words], bit t % 32 of word t // 32 (reference)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    out = torch.zeros(rows, words, dtype=torch.int64)
    for t in range(vocab):
        out[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)


@pytest.mark.parametrize("backend", [None, "torch_native"])
def test_bitmask_masks_bit_for_bit(backend):
    """apply_bitmask against masked_fill with the bool mask the bitmask was packed from: bits
    past the vocabulary ignored, tokens past the bitmask forbidden, and a logits row paired with
    another bitmask row (the sampler's copy orders rows its own way). None: the CPU's NumPy
    path; torch_native: the xgrammar route other devices take (Triton on CUDA shares it)."""
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 100, generator=g) < 0.3
    allowed[:, 96:] = True  # the last word's bits 0-3 in the vocabulary, 4-31 past it (set)
    packed = _pack(torch.cat([allowed, torch.ones(3, 28, dtype=torch.bool)], dim=1))
    logits = torch.randn(5, 100, generator=g)
    work = logits.clone()
    apply_bitmask(work, packed, [(0, 0), (1, 1), (2, 2)], backend)  # bitmask as it is
    torch.testing.assert_close(work[:3], logits[:3].masked_fill(~allowed, float("-inf")))
    assert torch.equal(work[3:], logits[3:])
    work = logits.clone()
    apply_bitmask(work, packed, [(4, 0), (1, 2)], backend)  # gathered into the logits' order
    torch.testing.assert_close(work[4], logits[4].masked_fill(~allowed[0], float("-inf")))
    torch.testing.assert_close(work[1], logits[1].masked_fill(~allowed[2], float("-inf")))
    assert torch.equal(work[[0, 2, 3]], logits[[0, 2, 3]])
    wide = torch.randn(2, 130, generator=g)  # past the mask's 4 words (128 tokens): forbidden
    work = wide.clone()
    apply_bitmask(work, packed, [(0, 1), (1, 0)], backend)
    assert torch.isinf(work[:, 128:]).all()
    torch.testing.assert_close(work[0, :100], wide[0, :100].masked_fill(~allowed[1], -torch.inf))


def test_sampler_masks_constrained_rows_only():
    g = torch.Generator().manual_seed(1)
    vocab = 300
    logits = torch.randn(4, vocab, generator=g) * 3
    allowed = torch.rand(4, vocab, generator=g) < 0.2
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_p=0.9)]
    bitmask = _pack(allowed[[0, 2]])  # one stacked bitmask for the step's constrained rows
    rows = [SamplingRow(p, bitmask_row={0: 0, 2: 1}.get(i)) for i, p in enumerate(params)]
    dist = Sampler().distribution(logits, rows, bitmask)
    ref0 = torch.softmax(logits[0].masked_fill(~allowed[0], float("-inf")) / 0.7, dim=-1)
    torch.testing.assert_close(dist[0], ref0)
    assert int(dist[2].argmax()) == int(logits[2].masked_fill(~allowed[2], -1e9).argmax())
    # the unconstrained rows are what they are without any constrained neighbour
    alone = Sampler().distribution(logits[[1, 3]], [rows[1], rows[3]])
    torch.testing.assert_close(dist[[1, 3]], alone)
    tokens = Sampler(seed=3)(logits, rows, bitmask).token_ids
    assert allowed[0, tokens[0]] and allowed[2, tokens[2]]
    with pytest.raises(ValueError, match="token_bitmask must be"):
        Sampler()(logits, rows)
    with pytest.raises(ValueError, match="bitmask_row must be in"):
        Sampler()(logits, rows, bitmask[:1])


def test_json_schema_regex_choice_in_a_mixed_batch(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = ["a", "b", "c", "d"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, n=2,
                             structured_outputs=so) if i % 2 == 0 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=12) for i in range(4)]
    params[3] = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                               structured_outputs={"regex": r"[a-z]{3}-\d{2}"})
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 2):
        assert len(outs[i].outputs) == 2
        for c in outs[i].outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3}-\d{2}", outs[3].outputs[0].text)
    assert len(outs[1].outputs[0].token_ids) == 12  # unconstrained: ran to max_tokens
    choice = llm.generate("x", SamplingParams(max_tokens=10, structured_outputs={
        "choice": ["a.b", "(x)", "c|d"]}), use_tqdm=False)[0].outputs[0].text
    assert choice in ("a.b", "(x)", "c|d")


def test_constrained_requests_survive_preemption():
    model = ensure_default_model()
    small = LLM(model=str(model), max_model_len=256, block_size=4, max_num_seqs=8,
                kv_cache_memory_bytes=48 * 4 * kv_bytes_per_token(model))
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = small.generate([" ".join(f"w{i}{j}" for j in range(12)) for i in range(8)],
                          [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                                          structured_outputs=so) for i in range(8)],
                          use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        value = json.loads(o.outputs[0].text)
        jsonschema.validate(value, SCHEMA)
        # no free whitespace: exactly json.dumps' separators
        assert o.outputs[0].text == json.dumps(value, ensure_ascii=False)
    small.engine.check_invariants()


def test_bad_grammar_is_a_value_error_and_queues_nothing(llm):
    for so in ({"regex": "(unclosed"}, {"json": {"type": "objekt"}}, {"grammar": "root ::= "}):
        with pytest.raises(ValueError, match="invalid"):
            llm.generate(["a", "b"], SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match="whitespace_pattern"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.usage == 0.0


def test_compiles_are_cached_and_a_compiling_request_can_be_aborted(llm):
    engine = llm.engine
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = engine.grammars.num_compiles
    rid = engine.add_request("x", SamplingParams(structured_outputs={"json": schema}))
    engine.abort_request(rid)  # whether compiled yet or not: gone, nothing held
    assert not engine.has_unfinished_requests()
    llm.generate(["a", "b"], SamplingParams(max_tokens=30, structured_outputs={
        "json": dict(reversed(list(schema.items())))}), use_tqdm=False)  # same schema, reordered
    assert engine.grammars.num_compiles == before + 1


def test_tool_call_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": "{\\"b\\": 2}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"b": 2})]
    assert all(c.id.startswith("call_") for c in calls)
    stream, streamed, pieces = ToolCallStream(), [], []
    for i in range(0, len(text), 5):
        piece, new = stream.feed(text[i:i + 5])
        pieces.append(piece)
        streamed += new
    pieces.append(stream.feed("", final=True)[0])
    assert "".join(pieces).strip() == "Let me check." and "<" not in "".join(pieces)
    # OpenAI's delta.tool_calls: index, id, type and name first, then argument fragments
    assert [e["function"]["name"] for e in streamed if "id" in e] == ["f", "g"]
    args = {k: "".join(e["function"]["arguments"] for e in streamed if e["index"] == k)
            for k in (0, 1)}
    assert json.loads(args[0]) == {"a": 1} and json.loads(args[1]) == {"b": 2}
    assert len(streamed) > 4  # the arguments came in more than one fragment each
    # what does not parse stays content; nothing is lost
    assert parse_tool_calls("<tool_call>{oops}</tool_call> <tool") == \
        ("<tool_call>{oops}</tool_call> <tool", [])


FORCED_CALLS = [("get_weather", {"city": "Pa}ri\\\"s", "unit": ["c", {"q": "]"}]}),
                ("get_time", {"zone": -3.5}), ("get_weather", {})]


def _read_forced(text: str, step: int, named: str | None = None) -> tuple[str, list[dict]]:
    reader = ForcedToolCalls(named, ["get_weather", "get_time"])
    events = []
    for i in range(0, len(text), step):
        events += reader.feed(text[i:i + step])[1]
    content, last = reader.feed("", final=True)
    return content, events + last


def test_forced_tool_call_reader():
    """The outputs a forced tool_choice's grammar allows, written by `json.dumps` (the
    independent serializer), read back in pieces of every size: "required"'s array of calls,
    and a named choice's bare arguments. Every prefix (max_tokens may stop anywhere) still
    reads as calls whose arguments are a prefix of the full ones, with the call whose name
    was cut kept when its name is known."""
    text = json.dumps([{"name": n, "arguments": a} for n, a in FORCED_CALLS])
    whole = [(n, json.dumps(a)) for n, a in FORCED_CALLS]
    for step in (1, 2, 3, 7, len(text)):
        content, events = _read_forced(text, step)
        calls = assemble(events)
        assert content == "" and [(c["function"]["name"], c["function"]["arguments"])
                                  for c in calls] == whole, step
        assert [e["index"] for e in events if "id" in e] == [0, 1, 2]  # each id once, first
        assert len({c["id"] for c in calls}) == 3 and all(c["type"] == "function"
                                                          for c in calls)
    for cut in range(len(text)):
        content, events = _read_forced(text[:cut], 5)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in assemble(events)]
        for (name, args), (want_name, want_args) in zip(calls, whole):
            assert name == want_name and want_args.startswith(args), (cut, calls)
        # the calls begun in the text, less one whose name is cut where both tools match
        begun = text[:cut].count('{"name": "')
        name_cut = text[:cut].endswith(('{"name": "', '{"name": "g', '{"name": "ge',
                                        '{"name": "get', '{"name": "get_'))
        assert len(calls) in (begun, begun - name_cut), (cut, calls)
        assert (content == text[:cut]) == (not calls), cut  # no call: nothing is lost
    args = json.dumps(FORCED_CALLS[0][1])
    for cut in range(len(args) + 1):
        content, events = _read_forced(args[:cut], 4, named="get_weather")
        assert content == "" and [(c["function"]["name"], c["function"]["arguments"])
                                  for c in assemble(events)] == [("get_weather", args[:cut])]
        assert "id" in events[0] and events[0]["function"]["name"] == "get_weather"
    one = ForcedToolCalls(None, ["only"])  # one tool: a call even before its name is written
    assert [c["function"]["name"] for c in assemble(one.feed("[{", final=True)[1])] == ["only"]


def test_forced_tool_choice_grammars_hold_the_tiny_model(llm):
    """What tool_choice "required" and a named function constrain a random-weight model to:
    output valid against the schema (jsonschema, the independent validator), with json.dumps'
    separators only, read back by ForcedToolCalls into calls whose arguments are valid against
    their tool's parameters. One tool's parameters refer to its `$defs`, which the required
    schema moves to its root, where the references then point."""
    from kvserve.structured.tool_calls import parameters_schema, required_calls_schema

    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
             "required": ["x"], "additionalProperties": False}
    tools = [{"name": "move", "parameters": {
                 "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"},
                                                  "why": {"type": "string", "maxLength": 4}},
                 "required": ["to", "why"], "additionalProperties": False,
                 "$defs": {"Point": point}}},
             {"name": "stop", "parameters": {"type": "object", "properties": {},
                                             "additionalProperties": False}}]
    cases = [(None, required_calls_schema(tools, parallel=False)),
             (None, required_calls_schema(tools[:1], parallel=False)),  # $defs moved: used
             ("move", parameters_schema(tools[0]))]
    for named, schema in cases:
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        outs = llm.generate("call", SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=300,
                                                   structured_outputs=so), use_tqdm=False)
        for c in outs[0].outputs:
            assert c.finish_reason == "stop", c.text
            value = json.loads(c.text)
            jsonschema.validate(value, schema)
            assert c.text == json.dumps(value, ensure_ascii=False)
            calls = assemble(ForcedToolCalls(named, ["move", "stop"]).feed(c.text, True)[1])
            assert len(calls) == 1, c.text
            fn = calls[0]["function"]
            params = {t["name"]: t["parameters"] for t in tools}[fn["name"]]
            jsonschema.validate(json.loads(fn["arguments"]), params)


def _byte_token_ids(tokenizer, data: bytes) -> list[int]:
    """The ids of the single-byte tokens of a byte-level BPE vocabulary (GPT-2's byte-to-
    character table, written out here so the test does not share the code it checks)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tokenizer.backend.token_to_id(chars[b]) for b in data]


@pytest.mark.parametrize("body, valid", [(b"a", True), ("é".encode(), True),
                                         ("\U0001F600".encode(), True),
                                         (b"\xed\xa0\x80", False), (b"\xed\xbf\xbf", False)])
def test_json_strings_hold_only_valid_utf8(body, valid):
    """A JSON string's characters are valid UTF-8: the three-byte forms of UTF-16 surrogates
    (which xgrammar's own string classes accept, and which decode to three U+FFFD) are refused,
    bounded (maxLength) and unbounded strings alike."""
    import xgrammar as xgr

    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.grammar import strict_json_strings
    from kvserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir("kvserve/assets/stdlib-coder")
    compiler = GrammarCompiler(tok, tok.backend.get_vocab_size(), [])
    for prop in ({"type": "string", "maxLength": 1}, {"type": "string"}):
        schema = {"type": "object", "properties": {"t": prop}, "required": ["t"],
                  "additionalProperties": False}
        grammar = strict_json_strings(xgr.Grammar.from_json_schema(schema,
                                                                    any_whitespace=False))
        matcher = xgr.GrammarMatcher(compiler._compiler.compile_grammar(grammar))
        assert all(matcher.accept_token(t) for t in _byte_token_ids(tok, b'{"t": "'))
        accepted = all(matcher.accept_token(t) for t in _byte_token_ids(tok, body + b'"}'))
        assert accepted == valid, (prop, body)
