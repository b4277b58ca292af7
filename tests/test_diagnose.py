"""`kvserve diagnose` and `kvserve serve --request-log`: the planted pollution of a generated log
is named, a clean log gets no false alarm, each class's predicted gain matches the gain measured
by serving the cleaned log through a real `kvserve serve`, and the request log round-trips."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from kvserve.diagnose import synth
from kvserve.diagnose.analyze import cleaned_records, diagnose, find_spans
from kvserve.diagnose.classify import classify
from kvserve.diagnose.divergence import Divergence, common_prefix
from kvserve.diagnose.log import (LogRecord, RequestLog, read_log, request_body,
                                  write_openai_log)
from kvserve.diagnose.normalize import FixContext, make_fix
from kvserve.diagnose.render import load_tokenizer, render_all
from kvserve.model_loader.make_model import ensure_default_model
from kvserve.server.request_log import RequestLog as ServerRequestLog

sys.path.insert(0, str(Path(__file__).parent))
from server_process import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def _log(bodies: list[dict]) -> RequestLog:
    return RequestLog([LogRecord(i, messages=b["messages"], cache_salt=b.get("cache_salt"))
                       for i, b in enumerate(bodies)], source="synth")


# ------------------------------------------------------------------------------------------
# classification, one pair of prompts at a time
# ------------------------------------------------------------------------------------------

def _classify(a: str, b: str) -> str:
    d = common_prefix(a, b)
    rec = LogRecord(1, prompt=a)
    return classify(Divergence(1, 0, d, d, len(a), len(a)), a, b, rec,
                    LogRecord(0, prompt=b)).cls


@pytest.mark.parametrize("a,b,cls", [
    ("Now: 2026-12-02T09:00:31Z. Answer briefly. Q: x", "Now: 2026-12-02T09:01:07Z. Answer "
     "briefly. Q: y", "timestamp"),
    ("Date: Wed, 02 Dec 2026 09:00:31 GMT\nBe kind. Q", "Date: Wed, 02 Dec 2026 10:11:12 GMT\n"
     "Be kind. Q", "timestamp"),
    ("ts=1764666031 and the rest of it", "ts=1764669999 and the rest of it", "timestamp"),
    ("req 3f2b8c1e-1d2a-4e5f-9a8b-7c6d5e4f3a2b, the rest", "req 9a0b1c2d-3e4f-4a5b-8c7d-"
     "6e5f4a3b2c1d, the rest", "id"),
    ("trace=a3f9c2e81b7d4f60 then the instructions", "trace=0c1d2e3f4a5b6c7d then the "
     "instructions", "id"),
    ("Request #1234 of the day. Be brief.", "Request #1299 of the day. Be brief.", "number"),
    ("You are a bot.  \n\nBe brief and kind.", "You are a bot.\n\nBe brief and kind.",
     "whitespace"),
    ("Ex A\n\nEx B\n\nEx C\n\nQ: one", "Ex B\n\nEx A\n\nEx C\n\nQ: two", "reordered"),
    # content, not pollution: the prompts do not agree again after the difference
    ("System.\n\nWhat is 12 + 7?", "System.\n\nWhat is 15 + 3?", "content"),
    ("System.\n\nHow do I resize a disk?", "System.\n\nHow do I delete a bucket?", "content"),
    ("System.\n\nQ: a and more", "System.\n\nQ: a", "extension"),
])
def test_classify_pairs(a, b, cls):
    assert _classify(a, b) == cls


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}{{ ' !' if loud is defined }}\n"
            "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
            "<|im_start|>assistant\n{% endif %}")


def test_template_drift(tiny, tmp_path):
    """Two clients send the same messages, one with a chat_template_kwargs the template reads
    in its markup."""
    tokenizer = _custom_tokenizer(tiny, tmp_path, TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    a = LogRecord(1, messages=msgs, chat_template_kwargs={"loud": True})
    b = LogRecord(0, messages=msgs)
    ra, rb = render_all(tokenizer, [a, b])
    d = common_prefix(ra.text, rb.text)
    got = classify(Divergence(1, 0, d, d, len(ra.text), len(ra.token_ids)), ra.text, rb.text,
                   a, b)
    assert got.cls == "template"
    fixed = make_fix("template", FixContext(template=(None, True)))(a)
    assert render_all(tokenizer, [fixed])[0].text == rb.text


def test_fixes_touch_their_own_class_only():
    ctx = FixContext(number_contexts={"Request #"})
    text = "At 2026-12-02T09:00:31Z, id 3f2b8c1e-1d2a-4e5f-9a8b-7c6d5e4f3a2b, Request #12; 7 " \
           "items."
    rec = LogRecord(0, prompt=text)
    assert make_fix("timestamp", ctx)(rec).prompt == text.replace("2026-12-02T09:00:31Z",
                                                                  "<timestamp>")
    assert make_fix("id", ctx)(rec).prompt == text.replace(
        "3f2b8c1e-1d2a-4e5f-9a8b-7c6d5e4f3a2b", "<id>")
    assert make_fix("number", ctx)(rec).prompt == text.replace("#12", "#<n>")
    assert make_fix("whitespace", ctx)(LogRecord(0, prompt="a  b \n\n\n\nc ")).prompt == \
        "a b\n\nc"


# ------------------------------------------------------------------------------------------
# whole logs
# ------------------------------------------------------------------------------------------

def test_names_every_planted_class(tokenizer):
    bodies = synth.generate(200, seed=3)
    got = diagnose(_log(bodies), tokenizer)
    assert {c.cls for c in got.classes} == set(synth.PLANTED)
    for c in got.classes:
        assert c.gain_points > 0.5, c
        planted = sum(b["planted"] == c.cls for b in bodies)
        # a fix changes the requests of its class, and (reordered) few besides
        assert planted <= c.requests <= planted + 5, (c, planted)
    assert got.hit_rate_all_fixed > max(c.hit_rate_fixed for c in got.classes)


def test_clean_log_has_no_pollution(tokenizer):
    got = diagnose(_log(synth.generate(200, seed=4, classes=())), tokenizer)
    assert got.classes == []
    assert got.divergences == {"first": 1, "content": 199}
    assert got.hit_rate > 0.9


def test_reads_openai_and_batch_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"meta": {"block_size": 32, "pool_blocks": 100}},
             {"time": 1.0, "cache_salt": "s", "messages": [{"role": "user", "content": "a"}],
              "prompt_tokens": 9, "cached_tokens": 0},
             {"model": "m", "messages": [{"role": "user", "content": "b"}], "max_tokens": 4},
             {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "c"}]}},
             {"custom_id": "y", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": ["d", "e"]}},
             {"prompt": [1, 2, 3]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    log = read_log(path)
    assert (log.block_size, log.pool_blocks) == (32, 100)
    assert [r.messages[0]["content"] if r.is_chat else r.prompt for r in log.records] == \
        ["a", "b", "c", "d", "e", [1, 2, 3]]
    assert log.records[0].cache_salt == "s" and log.served_hit_rate is None
    with pytest.raises(ValueError, match="messages or a prompt"):
        path.write_text('{"model": "m"}\n')
        read_log(path)


def test_overlapping_requests_are_noted(tokenizer):
    from kvserve.diagnose.report import render_text

    records = [LogRecord(i, messages=b["messages"], time=float(i), finished=i + 1.5)
               for i, b in enumerate(synth.generate(6, seed=7, classes=()))]
    log = RequestLog(records, source="concurrent")
    assert log.overlapped == 5
    assert "5 requests arrived while an earlier one was running" in \
        render_text(diagnose(log, tokenizer))


def test_unrenderable_requests_are_left_out(tokenizer):
    from kvserve.diagnose.report import render_text

    bodies = synth.generate(10, seed=8, classes=())
    records = [LogRecord(i, messages=b["messages"]) for i, b in enumerate(bodies)]
    records.insert(3, LogRecord(3, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]))
    got = diagnose(RequestLog(records, resets=[5]), tokenizer)
    assert got.requests == 10 and got.skipped == 1 and "request 3" in got.skip_reason
    assert "1 requests could not be rendered" in render_text(got)


def test_request_log_write_failure_is_not_fatal(tmp_path, caplog):
    log = ServerRequestLog(tmp_path, {"block_size": 16})  # a directory: cannot be opened
    log.write({"a": 1})
    log.close()
    assert "request log" in caplog.text


@pytest.mark.parametrize("breaker", ["\x85", "\u2028", "\u2029"])
def test_request_log_lines_survive_unicode_line_splitters(tmp_path, breaker):
    """A prompt holding a character str.splitlines() ends a line at: the server's log and a
    cleaned log both stay one record a line, and read back unchanged."""
    text = f"before{breaker}after"
    log = ServerRequestLog(tmp_path / "served.jsonl", {"block_size": 16})
    log.write({"prompt": text})
    log.close()
    cleaned = tmp_path / "cleaned.jsonl"
    write_openai_log([LogRecord(0, prompt=text)], cleaned)
    for path in (tmp_path / "served.jsonl", cleaned):
        lines = path.read_text(encoding="utf-8").splitlines()
        assert json.loads(lines[-1])["prompt"] == text, path.name


def test_cli_json_and_plot(tmp_path, tiny, capsys):
    from kvserve.entrypoints.cli import main

    path = tmp_path / "log.jsonl"
    synth.write(synth.generate(60, seed=5), str(path))
    plot = tmp_path / "fixes.png"
    assert main(["diagnose", str(path), "--model", tiny, "--json", "--plot", str(plot),
                 "--pool-blocks", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pool"] == {"block_size": 16, "pool_blocks": 200, "source": "flags",
                           "policy": "lru"}
    assert {c["cls"] for c in out["classes"]} == set(synth.PLANTED)
    assert plot.stat().st_size > 1000
    assert main(["diagnose", str(path), "--model", tiny]) == 0
    text = capsys.readouterr().out
    assert "timestamps and dates" in text and "all of the above fixed" in text


# ------------------------------------------------------------------------------------------
# the acceptance check: predicted gains against a real server
# ------------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_predicted_gain_matches_served_gain(tmp_path, tiny, tokenizer):
    """The log (one tenant in six salted) is served through `kvserve serve --request-log`
    with a pool small enough to evict; diagnose reads the server's own log (its header gives the pool), and each class's
    cleaned log is served again after /reset_prefix_cache. Hit rate = cached prompt tokens /
    prompt tokens, from usage.prompt_tokens_details.cached_tokens."""
    bodies = synth.generate(48, seed=1)
    for b in bodies[5::6]:  # a second tenant: its blocks are keyed apart
        b["cache_salt"] = "tenant-b"
    served_log = tmp_path / "requests.jsonl"
    srv = ServerProcess("diagnose", [tiny, "--request-log", str(served_log),
                                     "--kv-cache-memory-bytes", "2000000",
                                     "--allow-unauthenticated-admin"], tmp_path,  # the resets
                        max_model_len=2048)
    try:
        srv.wait_ready()

        def serve(records: list[LogRecord]) -> float:
            httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30).raise_for_status()
            hit = total = 0
            for r in records:
                resp = httpx.post(f"{srv.url}/v1/chat/completions", json=request_body(r),
                                  timeout=120)
                resp.raise_for_status()
                usage = resp.json()["usage"]
                hit += usage["prompt_tokens_details"]["cached_tokens"]
                total += usage["prompt_tokens"]
            return hit / total

        served = serve(_log(bodies).records)
        log = read_log(served_log)
        # the request log round-trips: the pool, the messages as sent, the cached tokens
        assert log.block_size == 16 and log.pool_blocks and log.pool_blocks < 300
        assert [r.messages for r in log.records] == [b["messages"] for b in bodies]
        assert [r.cache_salt for r in log.records] == [b.get("cache_salt") for b in bodies]
        assert log.meta["eviction_policy"] == "lru"
        assert log.served_hit_rate == pytest.approx(served)
        got = diagnose(log, tokenizer)
        assert got.pool.source == "request log"
        assert got.prompt_tokens > 3 * 16 * log.pool_blocks  # the pool evicts: a real test
        assert got.hit_rate == pytest.approx(served, abs=0.02)
        assert {c.cls for c in got.classes} == set(synth.PLANTED)
        measured = {}
        for c in got.classes:
            measured[c.cls] = 100 * (serve(cleaned_records(log, tokenizer, [c.cls])) - served)
        for c in got.classes:
            print(f"{c.cls}: predicted {c.gain_points:+.2f}, served {measured[c.cls]:+.2f}")
            assert abs(c.gain_points - measured[c.cls]) <= 2.0, (c, measured)
            assert measured[c.cls] > 2.0, (c, measured)  # a gain the 2 points can tell apart
        # the whole log, every run of it: the resets between runs are in it, and the replay
        # empties its cache there as the server did
        full = read_log(served_log)
        assert len(full.records) == 48 * (1 + len(got.classes))
        assert full.resets == [48 * k for k in range(1, 1 + len(got.classes))]
        assert diagnose(full, tokenizer).hit_rate == pytest.approx(full.served_hit_rate)
        assert full.overlapped == 0  # a sequential client
    finally:
        assert srv.stop() is None, srv.log()[-3000:]


def test_request_log_streams_and_completions(tmp_path, tiny):
    """Streamed chat and /v1/completions requests are logged too, one line per prompt."""
    served_log = tmp_path / "requests.jsonl"
    srv = ServerProcess("reqlog", [tiny, "--request-log", str(served_log)], tmp_path)
    try:
        srv.wait_ready()
        msgs = [{"role": "user", "content": "hello there"}]
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=60,
                          json={"messages": msgs, "max_tokens": 2, "stream": True,
                                "cache_salt": "tenant-a"}) as resp:
            assert resp.status_code == 200
            resp.read()
        for prompt in ("one two three", [5, 6, 7]):
            resp = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 1})
            assert resp.status_code == 200, resp.text
    finally:
        assert srv.stop() is None, srv.log()[-3000:]
    lines = [json.loads(x) for x in served_log.read_text().splitlines()]
    assert lines[0]["meta"]["format"] == "kvserve-request-log"
    assert [x.get("endpoint") for x in lines[1:]] == ["chat", "completions", "completions"]
    assert lines[1]["messages"] == msgs and lines[1]["cache_salt"] == "tenant-a"
    assert lines[2]["prompt"] == "one two three" and lines[3]["prompt_token_ids"] == [5, 6, 7]
    assert all(x["prompt_tokens"] > 0 and x["cached_tokens"] >= 0 for x in lines[1:])
    log = read_log(served_log)
    assert [r.cache_salt for r in log.records] == ["tenant-a", None, None]
    assert all(r.finished >= r.time for r in log.records) and log.overlapped == 0
    assert len(find_spans(log.records, render_all(load_tokenizer(tiny), log.records))) == 3


def _custom_tokenizer(tiny: str, tmp_path: Path, template: str):
    """The tiny model's tokenizer with another chat template."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(tmp_path))


def test_reordered_messages_and_tools(tiny, tmp_path):
    """Few-shot turns sent as messages, and tool definitions, in a per-request order: both are
    named, and the fix puts them in the log's most common order."""
    import random

    tools_template = ("{% if tools %}<|im_start|>tools\n{% for t in tools %}"
                      "{{ t.function.name }}: {{ t.function.description }}\n\n{% endfor %}"
                      "<|im_end|>\n{% endif %}" + TEMPLATE)
    tokenizer = _custom_tokenizer(tiny, tmp_path, tools_template)
    rng = random.Random(0)
    shots = [[{"role": "user", "content": f"Example question {w}?"},
              {"role": "assistant", "content": f"The answer about {w} is short."}]
             for w in ("disks", "buckets", "keys", "domains")]
    tools = [{"type": "function", "function": {"name": n, "description": f"Do {n} things "
                                               "with the account, carefully and well."}}
             for n in ("search", "resize", "bill", "restore")]
    records = []
    for i in range(40):
        pairs, ts = list(shots), list(tools)
        if i % 3 == 1:
            rng.shuffle(pairs)
        if i % 3 == 2:
            rng.shuffle(ts)
        msgs = [{"role": "system", "content": "Be brief."}] + [m for p in pairs for m in p] + \
            [{"role": "user", "content": f"Question number {chr(65 + i % 26)}{i} here"}]
        records.append(LogRecord(i, messages=msgs, tools=ts))
    got = diagnose(RequestLog(records), tokenizer)
    assert [c.cls for c in got.classes] == ["reordered"]
    assert got.classes[0].gain_points > 5
    levels = {f.level for f in find_spans(records, render_all(tokenizer, records))
              if f.cls == "reordered"}
    assert levels == {"messages", "tools"}
    fixed = cleaned_records(RequestLog(records), tokenizer, ["reordered"])
    assert all(r.tools == tools and r.messages[1:9] == [m for p in shots for m in p]
               for r in fixed)


def test_changing_number_in_the_system_prompt(tokenizer):
    """A counter templated into the system prompt is named, and its fix replaces the counter
    only, not the numbers elsewhere."""
    bodies = synth.generate(60, seed=6, classes=())
    for i, b in enumerate(bodies):
        system = b["messages"][0]
        intro, rest = system["content"].split("\n\n", 1)
        system["content"] = f"{intro}\n\nYou have answered {100 + 7 * i} questions today.\n\n" \
            f"{rest}"
    log = _log(bodies)
    got = diagnose(log, tokenizer)
    assert [c.cls for c in got.classes] == ["number"]
    assert got.classes[0].gain_points > 20
    fixed = cleaned_records(log, tokenizer, ["number"])
    assert len({r.messages[0]["content"] for r in fixed}) == 1
    assert "You have answered <n> questions today." in fixed[0].messages[0]["content"]


def test_default_model_is_the_embedded_one(tmp_path, capsys):
    """Without --model, requests are rendered as `kvserve serve` without a model renders them:
    the embedded SmolLM2's tokenizer and ChatML template."""
    from kvserve.model_loader.default import embedded_model_path

    try:
        embedded_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    from kvserve.entrypoints.cli import main

    tokenizer = load_tokenizer(None)
    r = render_all(tokenizer, [LogRecord(0, messages=[{"role": "user", "content": "hi"}])])[0]
    assert r.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    path = tmp_path / "log.jsonl"
    synth.write(synth.generate(100, seed=9), str(path))
    assert main(["diagnose", str(path), "--json"]) == 0
    assert {c["cls"] for c in json.loads(capsys.readouterr().out)["classes"]} == \
        set(synth.PLANTED)


def test_template_drift_of_a_client_rendered_prompt(tokenizer):
    """Half the traffic renders its own template for /v1/completions, with another role
    header: named as template drift, and fixed to the server's rendering."""
    from kvserve.diagnose.render import render_text

    records = []
    for i, b in enumerate(synth.generate(60, seed=10, classes=())):
        chat = LogRecord(i, messages=b["messages"])
        if i % 2:
            text = render_text(tokenizer, chat).replace("<|im_start|>system\n",
                                                        "<|im_start|>System\n")
            records.append(LogRecord(i, prompt=text))
        else:
            records.append(chat)
    log = RequestLog(records)
    got = diagnose(log, tokenizer)
    assert [c.cls for c in got.classes] == ["template"]
    # an unbounded pool keeps both renderings: the drift costs each its first request only
    assert got.classes[0].requests == 30 and got.classes[0].gain_points > 1
    fixed = cleaned_records(log, tokenizer, ["template"])
    assert all(render_text(tokenizer, f) == render_text(tokenizer, LogRecord(0, messages=b[
        "messages"])) for f, b in zip(fixed, synth.generate(60, seed=10, classes=())))
