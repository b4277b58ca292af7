"""Probe: malformed and hostile requests against a real `kvserve serve`, with well-formed
streaming requests running alongside (issue 11, reliability: acceptance of defects 2 to 7).

    .venv/bin/python benchmarks/probe_malformed.py [--json OUT] [--threads 2]

Starts `kvserve serve` on 127.0.0.1 (a free port) with the embedded default model and the
default limits, then:

1. runs the well-formed streams alone (through the official `openai` client and raw httpx) and
   keeps their text (greedy, ignore_eos);
2. runs them again while ~100 malformed requests go in at the same time (bad Unicode in every
   string field, wrong types, huge fields, too many stop strings, negative and out-of-vocabulary
   ids, over-long prompts, huge n, many prompts, an oversized body, broken JSON), some through
   the `openai` client, the rest with httpx;
3. with a /health poller (every 10 ms, its own thread and connection) and a sampler of the
   server's /proc/PID/status (VmRSS every 5 ms, VmHWM), sends 20 MB prompts (completion and
   chat) and requests of 131,072 and 131,072 sequences (1,024 prompts x n=128 and 2,048 x 64),
   all of which must be refused.

Reported: answers by status, the count of 5xx answers and of dropped connections (must be 0),
neighbours harmed (a good stream that failed or whose text differs from step 1; must be 0),
/health p50/p99/max while the heavy requests were refused (p99 must be < 100 ms), and peak
VmRSS during those refusals against idle VmRSS (must be < 1.5x). Exit status 1 if any target
is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from kvserve.bench import spawn

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
SURROGATE = "\\ud800"  # a lone surrogate, as the escape a JSON body carries
MB = 1024**2


# ------------------------------------------------------------------------------------------
# the server process
# ------------------------------------------------------------------------------------------

def start_server(threads: int, show_log: bool) -> tuple[subprocess.Popen, str]:
    """`kvserve serve` with the default model on a free port of 127.0.0.1, ready."""
    port = spawn.free_port()
    cmd = spawn.kvserve_command(port, None, ["--num-threads", str(threads)])
    proc = subprocess.Popen(cmd, stdout=sys.stderr if show_log else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    spawn.wait_healthy(proc, url, 300)
    return proc, url


stop_server = spawn.stop


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


# ------------------------------------------------------------------------------------------
# the well-formed streams
# ------------------------------------------------------------------------------------------

GOOD = [
    ("openai-completion", dict(prompt="The kernel scheduler keeps a queue of", max_tokens=48)),
    ("openai-chat", dict(messages=[{"role": "user", "content": "Tell me about caches."}],
                         max_tokens=48)),
    ("httpx-completion-n2", dict(prompt="Once upon a time, in a land far away,", n=2,
                                 max_tokens=48)),
    ("httpx-chat", dict(messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Name three colours."}],
                        max_tokens=48)),
]


async def _openai_stream(client: openai.AsyncOpenAI, name: str, spec: dict) -> dict[int, str]:
    common = dict(model="default", temperature=0, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    if "messages" in spec:
        stream = await client.chat.completions.create(**common, **spec)
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    else:
        stream = await client.completions.create(**common, **spec)
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    return texts


async def _httpx_stream(http: httpx.AsyncClient, url: str, spec: dict) -> dict[int, str]:
    path = CHAT if "messages" in spec else C
    body = dict(spec, temperature=0, stream=True, ignore_eos=True)
    texts: dict[int, str] = {}
    async with http.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


async def run_good(url: str) -> dict[str, Any]:
    """Every good stream, concurrently; an exception is the stream's result."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=300)
    async with httpx.AsyncClient(timeout=300) as http:
        tasks = [(_openai_stream(client, name, spec) if name.startswith("openai")
                  else _httpx_stream(http, url, spec)) for name, spec in GOOD]
        results = await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return {name: r for (name, _), r in zip(GOOD, results)}


# ------------------------------------------------------------------------------------------
# the malformed requests
# ------------------------------------------------------------------------------------------

def _raw(template: str) -> bytes:
    return template.replace("%s", SURROGATE).encode()


def malformed_http() -> list[tuple[str, str, Any]]:
    """(name, path, body: dict, raw bytes or an iterator of bytes)."""
    bad_unicode = [
        ("unicode-model", C, '{"model": "%s", "prompt": "hi"}'),
        ("unicode-prompt", C, '{"prompt": "a%sb"}'),
        ("unicode-prompt-list", C, '{"prompt": ["ok", "%s"]}'),
        ("unicode-stop", C, '{"prompt": "hi", "stop": "%s"}'),
        ("unicode-stop-list", C, '{"prompt": "hi", "stop": ["x", "%s"]}'),
        ("unicode-cache-salt", C, '{"prompt": "hi", "cache_salt": "%s"}'),
        ("unicode-user", C, '{"prompt": "hi", "user": "%s"}'),
        ("unicode-suffix", C, '{"prompt": "hi", "suffix": "%s"}'),
        ("unicode-extra-key", C, '{"prompt": "hi", "%s": 1}'),
        ("unicode-logit-bias-key", C, '{"prompt": "hi", "logit_bias": {"%s": 1}}'),
        ("unicode-chat-content", CHAT, '{"messages": [{"role": "user", "content": "%s"}]}'),
        ("unicode-chat-role", CHAT, '{"messages": [{"role": "%s", "content": "hi"}]}'),
        ("unicode-chat-name", CHAT,
         '{"messages": [{"role": "user", "content": "hi", "name": "%s"}]}'),
        ("unicode-chat-part", CHAT,
         '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}'),
        ("unicode-chat-model", CHAT, '{"model": "%s", "messages": [{"role": "user", '
         '"content": "hi"}]}'),
        ("unicode-chat-stop", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"stop": ["%s"]}'),
        ("unicode-chat-salt", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"cache_salt": "%s"}'),
        ("unicode-tool-choice", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"tool_choice": "%s"}'),
        ("unicode-template-kwargs", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"chat_template_kwargs": {"x": "%s"}}'),
        ("unicode-tools", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"tools": [{"type": "function", "function": {"name": "%s"}}]}'),
        ("unicode-response-format", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
         '"response_format": {"type": "%s"}}'),
        ("unicode-low-surrogate", C, '{"prompt": "\\udc00"}'),
        ("unicode-reversed-pair", C, '{"prompt": "\\ude00\\ud83d"}'),
    ]
    cases: list[tuple[str, str, Any]] = [(n, p, _raw(t)) for n, p, t in bad_unicode]
    cases += [
        ("not-utf8-bytes", C, b'{"prompt": "\xff\xfe"}'),
        ("bad-json", C, b'{"prompt": "hi",'),
        ("nan", C, b'{"prompt": "hi", "temperature": NaN}'),
        ("empty-body", C, b""),
        ("body-is-list", C, b"[1, 2]"),
        # wrong types
        ("type-prompt-number", C, {"prompt": 42}),
        ("type-prompt-object", C, {"prompt": {"a": 1}}),
        ("type-max-tokens-string", C, {"prompt": "hi", "max_tokens": "ten"}),
        ("type-n-bool", C, {"prompt": "hi", "n": True}),
        ("type-stop-number", C, {"prompt": "hi", "stop": 5}),
        ("type-seed-float", C, {"prompt": "hi", "seed": 1.5}),
        ("type-salt-number", C, {"prompt": "hi", "cache_salt": 7}),
        ("type-priority-string", C, {"prompt": "hi", "priority": "high"}),
        ("type-messages-string", CHAT, {"messages": "hi"}),
        ("type-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}),
        ("type-logprobs-string", CHAT, {"messages": MSG, "logprobs": "yes"}),
        ("type-stream-options", C, {"prompt": "hi", "stream": True, "stream_options": "x"}),
        # huge fields
        ("huge-model-5MB", C, {"model": "m" * (5 * MB), "prompt": "hi"}),
        ("huge-salt-1MB", C, {"prompt": "hi", "cache_salt": "s" * MB}),
        ("huge-user-5MB", C, {"prompt": "hi", "user": "u" * (5 * MB), "max_tokens": 1}),
        ("huge-stop-1MB", C, {"prompt": "hi", "stop": "z" * MB, "max_tokens": 2}),
        ("huge-logit-bias", C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(50_000)}}),
        ("huge-role-1MB", CHAT, {"messages": [{"role": "r" * MB, "content": "hi"}]}),
        ("huge-template-kwargs", CHAT, {"messages": MSG, "max_tokens": 2,
                                        "chat_template_kwargs": {"x": "y" * MB}}),
        ("huge-max-tokens", C, {"prompt": "hi", "max_tokens": 10**12}),
        ("huge-seed", C, {"prompt": "hi", "seed": 2**70}),
        # stop strings and ids
        ("stops-17", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}),
        ("stops-1000", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}),
        ("stop-empty", C, {"prompt": "hi", "stop": [""]}),
        ("stop-ids-negative", C, {"prompt": "hi", "stop_token_ids": [-1]}),
        ("stop-ids-oov", C, {"prompt": "hi", "stop_token_ids": [10**7]}),
        ("stop-ids-2000", C, {"prompt": "hi", "stop_token_ids": list(range(2000))}),
        ("prompt-ids-negative", C, {"prompt": [1, -2, 3]}),
        ("prompt-ids-oov", C, {"prompt": [1, 2, 10**9]}),
        ("prompt-ids-float", C, {"prompt": [1, 2.5]}),
        ("prompt-ids-nested-negative", C, {"prompt": [[1, 2], [-5]]}),
        # over-long prompts
        ("long-prompt-ids", C, {"prompt": [5] * 2049}),
        ("long-prompt-ids-200k", C, {"prompt": [7] * 200_000}),
        ("long-prompt-text-1MB", C, {"prompt": "word " * (MB // 5)}),
        ("long-prompt-text-30k", C, {"prompt": "word " * 6000}),
        ("long-chat-1MB", CHAT, {"messages": [{"role": "user", "content": "x" * MB}]}),
        ("prompt-at-limit", C, {"prompt": [5] * 2048, "max_tokens": 1}),
        # n and many prompts
        ("n-zero", C, {"prompt": "hi", "n": 0}),
        ("n-129", C, {"prompt": "hi", "n": 129}),
        ("n-million", C, {"prompt": "hi", "n": 10**6}),
        ("prompts-1025", C, {"prompt": ["hi"] * 1025, "max_tokens": 1}),
        ("prompts-2048", C, {"prompt": ["hi"] * 2048, "max_tokens": 1}),
        ("prompts-5000", C, {"prompt": ["hi"] * 5000}),
        ("prompts-16x128", C, {"prompt": ["hi"] * 16, "n": 128}),
        ("prompts-1024x128", C, {"prompt": ["hi"] * 1024, "n": 128}),
        # the body itself
        ("body-40MB", C, b'{"prompt": "' + b"a" * (40 * MB) + b'"}'),
        ("body-40MB-chunked", C, _chunks(b'{"prompt": "' + b"a" * (40 * MB) + b'"}')),
        # unsupported features
        ("echo", C, {"prompt": "hi", "echo": True}),
        ("best-of", C, {"prompt": "hi", "best_of": 3}),
        ("tool-choice-required", CHAT, {"messages": MSG, "tool_choice": "required"}),
        ("unknown-model", C, {"model": "gpt-4", "prompt": "hi"}),
    ]
    return cases


def _chunks(data: bytes, size: int = 1 << 20):
    """An upload without Content-Length (chunked transfer encoding)."""
    async def gen():
        for i in range(0, len(data), size):
            yield data[i:i + size]
    return gen()


async def malformed_openai(url: str) -> list[tuple[str, int | str]]:
    """A few malformed calls through the official client: its status (or the error type)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    calls = [
        ("openai-unicode-model", lambda: client.completions.create(
            model="\ud800", prompt="hi", max_tokens=2)),
        ("openai-unicode-prompt", lambda: client.completions.create(
            model="default", prompt="hi \udfff", max_tokens=2)),
        ("openai-unicode-role", lambda: client.chat.completions.create(
            model="default", messages=[{"role": "\ud800", "content": "hi"}])),
        ("openai-unicode-salt", lambda: client.completions.create(
            model="default", prompt="hi", max_tokens=2, extra_body={"cache_salt": "\ud800"})),
        ("openai-stops-17", lambda: client.completions.create(
            model="default", prompt="hi", stop=[f"s{i}" for i in range(17)])),
        ("openai-n-200", lambda: client.completions.create(model="default", prompt="hi", n=200)),
        ("openai-prompts-2048", lambda: client.completions.create(
            model="default", prompt=["hi"] * 2048, max_tokens=1)),
        ("openai-oov-stop-ids", lambda: client.completions.create(
            model="default", prompt="hi", extra_body={"stop_token_ids": [10**6]})),
        ("openai-unicode-stream", lambda: _drain(client.chat.completions.create(
            model="default", stream=True, messages=[{"role": "user", "content": "\ud800"}]))),
    ]
    out: list[tuple[str, int | str]] = []
    for name, call in calls:
        try:
            await call()
            out.append((name, 200))
        except openai.APIStatusError as exc:
            out.append((name, exc.status_code))
        except openai.APIConnectionError as exc:
            out.append((name, f"connection error: {exc!r}"))
        except UnicodeEncodeError:  # the client cannot send it: nothing reached the server
            out.append((name, "not sent: the client cannot encode it"))
    await client.close()
    return out


async def _drain(coro) -> None:
    async for _ in await coro:
        pass


async def send_malformed(url: str, cases: list[tuple[str, str, Any]],
                         concurrency: int = 8) -> list[tuple[str, int | str]]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_keepalive_connections=0)

    async def one(http: httpx.AsyncClient, name: str, path: str, body: Any):
        async with sem:
            try:
                if isinstance(body, dict):
                    r = await http.post(f"{url}{path}", json=body)
                else:
                    r = await http.post(f"{url}{path}", content=body,
                                        headers={"content-type": "application/json"})
                return name, r.status_code
            except httpx.HTTPError as exc:
                return name, f"connection error: {exc!r}"

    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return list(await asyncio.gather(*(one(http, *c) for c in cases)))


# ------------------------------------------------------------------------------------------
# /health and RSS while heavy requests are refused
# ------------------------------------------------------------------------------------------

def _poll_health(url: str, stop, conn) -> None:
    """The /health poller, in a process of its own: in the sender's process it would measure
    the sender too (asyncio's transport holds the GIL for long while it sends 20 MB)."""
    latencies: list[float] = []
    bad = 0
    with httpx.Client(timeout=5) as http:
        http.get(f"{url}/health")  # connected: ready
        conn.send("ready")
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = http.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(1000 * (time.perf_counter() - t0))
            bad += not ok
            time.sleep(0.01)
    conn.send((latencies, bad))


@dataclass
class Watch:
    """A /health poller (its own process) and a VmRSS sampler (a thread: /proc reads)."""

    url: str
    pid: int
    health_ms: list[float] = field(default_factory=list)
    health_bad: int = 0
    rss_kb: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _sample_rss(self) -> None:
        while not self._stop.is_set():
            self.rss_kb.append(proc_status_kb(self.pid, "VmRSS"))
            time.sleep(0.005)

    def __enter__(self) -> "Watch":
        ctx = multiprocessing.get_context("spawn")
        self._poller_stop = ctx.Event()
        self._conn, child = ctx.Pipe()
        self._poller = ctx.Process(target=_poll_health, args=(self.url, self._poller_stop, child))
        self._poller.start()
        assert self._conn.recv() == "ready"
        self._thread = threading.Thread(target=self._sample_rss, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._poller_stop.set()
        self.health_ms, self.health_bad = self._conn.recv()
        self._poller.join()
        self._stop.set()
        self._thread.join()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def heavy_bodies() -> list[tuple[str, str, bytes]]:
    """Encoded up front, so that the client's own JSON encoding does not disturb the poller."""
    text = "word " * (4 * 1000**2)  # 20 MB
    return [
        ("prompt-20MB", C, json.dumps({"prompt": text}).encode()),
        ("chat-20MB", CHAT, json.dumps({"messages": [{"role": "user",
                                                      "content": text}]}).encode()),
        ("seqs-1024x128", C, json.dumps({"prompt": ["hi"] * 1024, "n": 128}).encode()),
        ("seqs-2048x64", C, json.dumps({"prompt": [[1, 2, 3]] * 2048, "n": 64}).encode()),
    ]


def send_heavy(url: str, bodies: list[tuple[str, str, bytes]], rounds: int
               ) -> list[tuple[str, int | str, float]]:
    """One after another, with a blocking client: asyncio's transport (Python 3.11) moves a
    20 MB write buffer down after every send, burning the CPU the server needs."""
    out = []
    with httpx.Client(timeout=300) as http:
        for _ in range(rounds):
            for name, path, body in bodies:
                t0 = time.perf_counter()
                try:
                    r = http.post(f"{url}{path}", content=body,
                                  headers={"content-type": "application/json"})
                    status: int | str = r.status_code
                except httpx.HTTPError as exc:
                    status = f"connection error: {exc!r}"
                out.append((name, status, time.perf_counter() - t0))
    return out


# ------------------------------------------------------------------------------------------

def harmed(alone: dict[str, Any], together: dict[str, Any]) -> list[str]:
    return [name for name in alone
            if isinstance(together[name], BaseException) or together[name] != alone[name]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the heavy requests")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--server-log", action="store_true", help="show the server's log")
    args = parser.parse_args()

    proc, url = start_server(args.threads, args.server_log)
    try:
        alone = asyncio.run(run_good(url))
        bad_alone = [n for n, r in alone.items() if isinstance(r, BaseException)]
        if bad_alone:
            raise RuntimeError(f"good streams failed even alone: {bad_alone} {alone}")

        async def flood():
            good = asyncio.ensure_future(run_good(url))
            answers = await send_malformed(url, malformed_http())
            answers += await malformed_openai(url)
            return await good, answers

        together, answers = asyncio.run(flood())
        hurt = harmed(alone, together)

        time.sleep(1.0)
        idle_rss = statistics.median(proc_status_kb(proc.pid, "VmRSS") for _ in range(5))
        hwm_before = proc_status_kb(proc.pid, "VmHWM")
        with Watch(url, proc.pid) as idle_watch:
            time.sleep(1.0)
        bodies = heavy_bodies()
        with Watch(url, proc.pid) as watch:
            time.sleep(0.2)
            heavy = send_heavy(url, bodies, args.rounds)
            time.sleep(0.2)
        hwm_after = proc_status_kb(proc.pid, "VmHWM")
        alive = proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
    finally:
        stop_server(proc)

    all_answers = answers + [(n, s) for n, s, _ in heavy]
    by_status: dict[str, int] = {}
    for _, status in all_answers:
        key = str(status) if isinstance(status, int) else status.split(":")[0]
        by_status[key] = by_status.get(key, 0) + 1
    five_xx = [(n, s) for n, s in all_answers if isinstance(s, int) and s >= 500]
    dropped = [(n, s) for n, s in all_answers
               if isinstance(s, str) and s.startswith("connection error")]
    not_sent = [n for n, s in all_answers if isinstance(s, str) and s.startswith("not sent")]
    accepted_heavy = [(n, s) for n, s, _ in heavy if s != 400]
    peak_rss = max(watch.rss_kb)
    figures = {
        "malformed_requests": len(answers), "heavy_requests": len(heavy),
        "answers_by_status": dict(sorted(by_status.items())),
        "5xx": len(five_xx), "dropped_connections": len(dropped),
        "not_sent_by_the_client": not_sent,
        "heavy_not_refused_with_400": len(accepted_heavy),
        "good_streams": len(GOOD), "neighbours_harmed": len(hurt),
        "health_idle_p99_ms": percentile(idle_watch.health_ms, 99),
        "health_samples_during_heavy": len(watch.health_ms),
        "health_p50_ms": percentile(watch.health_ms, 50),
        "health_p99_ms": percentile(watch.health_ms, 99),
        "health_max_ms": max(watch.health_ms), "health_not_200": watch.health_bad,
        "heavy_refusal_s": {n: round(max(t for m, _, t in heavy if m == n), 3)
                            for n, _, _ in bodies},
        "idle_rss_mb": idle_rss / 1024, "peak_rss_during_heavy_mb": peak_rss / 1024,
        "peak_over_idle": peak_rss / idle_rss,
        "vmhwm_before_mb": hwm_before / 1024, "vmhwm_after_mb": hwm_after / 1024,
        "server_alive_after": alive,
    }
    print(f"malformed requests: {len(answers)} (+ {len(heavy)} heavy), answers by status: "
          f"{figures['answers_by_status']}")
    for name, status in answers:
        print(f"  {status!s:>4}  {name}")
    print(f"5xx answers: {len(five_xx)} {five_xx}")
    print(f"dropped connections: {len(dropped)} {dropped}")
    print(f"heavy requests not refused with 400: {accepted_heavy}")
    print(f"neighbours harmed: {len(hurt)} of {len(GOOD)} good streams {hurt}")
    print(f"/health while refusing 20 MB prompts and 131,072-sequence requests: "
          f"p50 {figures['health_p50_ms']:.1f} ms, p99 {figures['health_p99_ms']:.1f} ms, "
          f"max {figures['health_max_ms']:.1f} ms over {len(watch.health_ms)} probes "
          f"(idle p99 {figures['health_idle_p99_ms']:.1f} ms); refusal times "
          f"{figures['heavy_refusal_s']}")
    print(f"server RSS: idle {figures['idle_rss_mb']:.0f} MB, peak during the heavy refusals "
          f"{figures['peak_rss_during_heavy_mb']:.0f} MB ({figures['peak_over_idle']:.2f}x); "
          f"VmHWM {figures['vmhwm_before_mb']:.0f} -> {figures['vmhwm_after_mb']:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "answers": all_answers}, f, indent=1, default=str)
    ok = (not five_xx and not dropped and not hurt and not accepted_heavy and alive
          and figures["health_p99_ms"] < 100 and figures["peak_over_idle"] < 1.5
          and watch.health_bad == 0)
    print("PASS" if ok else "FAIL (--server-log shows the server's log)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
