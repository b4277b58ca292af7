"""`kvserve demo` (what `make demo` runs): one screen that shows what kvserve is for, on the
embedded SmolLM2-135M-Instruct.

1. The OpenAI-compatible server (a real HTTP server on a free local port) streams chat answers
   token by token, as any client sees them.
2. A long shared system prompt (a reference document, then a different question each): the
   first request computes it cold, the others are served from the prefix cache; each line
   shows cached prompt tokens and TTFT, as the API reports and the client measures them.
3. The same question with the KV cache in fp8 and int8: how many tokens the same memory holds,
   and what each does to the answer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import statistics
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.engine.llm import LLM
from kvserve.sampling import SamplingParams

# "Answer in one sentence.": without it the first token is a near tie on the Q4_1 model
# ("The" -1.88 against "L" -1.97 nats), which the 8-bit activations of an integer-kernel
# prefill flip into a French ramble; with it both prefill paths answer the same.
CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
]
# Round 2's shared system prompt: the history section of the running Python's own LICENSE file
# (on every machine that has Python, and real English text).
DOCUMENT_CHARS = 5000
QUESTIONS = [
    "Who created Python?",
    "In which country was Python created?",
    "Which language was Python a successor of?",
    "Where did Guido continue his work on Python in 1995?",
]
KV_DTYPES = ("auto", "fp8", "int8")


@dataclass
class DemoOptions:
    max_tokens: int = 64  # of each streamed chat answer (the demo decodes greedily)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamResult:
    text: str
    ttft: float  # seconds from sending the request to the first content delta
    cached_tokens: int
    prompt_tokens: int


def document() -> str:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    return text[:DOCUMENT_CHARS].rsplit("\n\n", 1)[0]


class DemoServer:
    """`kvserve serve`'s app on the demo's own engine, in a thread, on a free loopback port."""

    def __init__(self, llm_kwargs: dict[str, Any]) -> None:
        import uvicorn

        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.server.app import build_app
        from kvserve.server.launch import served_names

        self.engine = AsyncLLMEngine.from_kwargs(log_stats=False, **llm_kwargs)
        self.name = served_names(argparse.Namespace(served_model_name=None,
                                                    model=llm_kwargs.get("model")))[0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(build_app(self.engine, [self.name]), host="127.0.0.1",
                                port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "DemoServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the demo server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.engine.shutdown()

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int,
                    echo: bool = True) -> StreamResult:
        """POST /v1/chat/completions with stream=true, printing each delta as it arrives."""
        body = json.dumps({"model": self.name, "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"server answered {response.status}: {response.read()[:300]!r}")
        text, ttft, usage = [], 0.0, {}
        for event in _sse_events(response):
            for choice in event.get("choices") or []:
                delta = choice.get("delta", {}).get("content") or ""
                if delta and not text:
                    ttft = time.perf_counter() - t0
                if delta:
                    text.append(delta)
                    if echo:
                        print(delta, end="", flush=True)
            usage = event.get("usage") or usage
        conn.close()
        details = usage.get("prompt_tokens_details") or {}
        return StreamResult("".join(text), ttft, int(details.get("cached_tokens") or 0),
                            int(usage.get("prompt_tokens") or 0))


def _sse_events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def round_one(server: DemoServer, opts: DemoOptions) -> None:
    print(f"== 1. Chat answers streamed from the server ({server.name}, "
          f"http://127.0.0.1:{server.port}/v1/chat/completions)")
    for question in CHATS:
        print(f"\n  user: {question}\n  assistant: ", end="", flush=True)
        out = server.stream_chat([{"role": "user", "content": question}], opts.max_tokens)
        print(f"\n  (first token after {out.ttft * 1000:.0f} ms)")


def round_two(server: DemoServer, opts: DemoOptions) -> None:
    doc = document()
    system = ("Answer the user's question in one short sentence, using this document.\n\n"
              + doc)
    results = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        results.append(server.stream_chat(messages, 32, echo=False))
    print(f"\n== 2. A long shared system prompt (the history in Python's LICENSE.txt: "
          f"{results[1].cached_tokens:,} tokens in common), a different question each")
    print(f"  {'request':<9}{'prompt':>7}{'cached':>8}{'TTFT ms':>9}  answer")
    for i, (q, r) in enumerate(zip(QUESTIONS, results)):
        answer = " ".join(r.text.split())[:70]
        print(f"  {'cold' if i == 0 else 'warm':<9}{r.prompt_tokens:>7}{r.cached_tokens:>8}"
              f"{r.ttft * 1000:>9.0f}  {q} -> {answer}")
    cold = results[0].ttft
    warm = statistics.median(r.ttft for r in results[1:])
    print(f"  TTFT cold {cold * 1000:.0f} ms vs cached {warm * 1000:.0f} ms (median of "
          f"{len(results) - 1}): {cold / max(warm, 1e-6):.1f}x faster; the prefix is stored once")


def round_three(opts: DemoOptions) -> None:
    """The KV cache's storage format: capacity in the same memory, and the answer it gives."""
    question = [{"role": "user", "content": CHATS[0]}]
    print("\n== 3. The KV cache in fp8 and int8: the same memory, and the same question")
    print(f"  {'kv dtype':<10}{'bytes/token':>12}{'tokens in pool':>16}  answer (greedy)")
    reference: list[int] | None = None
    # The three engines' start-up lines (loader, kernels, KV capacity) would split the table.
    logging.getLogger("kvserve").setLevel(logging.WARNING)
    for kv_dtype in KV_DTYPES:
        # fp8 scales computed from the first batch (vLLM's calculate_kv_scales): the GGUF
        # carries none, and 1.0 is a poor scale for this model's keys
        llm = LLM(**{**opts.engine_kwargs, "kv_cache_dtype": kv_dtype,
                     "calculate_kv_scales": kv_dtype == "fp8"})
        out = llm.chat(question, SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)[0].outputs[0]
        kv = llm.engine.kv
        per_token = llm.engine.kv_spec.bytes_per_token
        tokens = list(out.token_ids)
        if reference is None:
            reference, same = tokens, ""
        elif tokens == reference:
            same = "  (= the float32 answer)"
        else:
            same = f"  (differs from token {_first_difference(tokens, reference)})"
        label = "float32" if kv_dtype == "auto" else kv_dtype
        print(f"  {label:<10}{per_token:>12,}{kv.num_blocks * kv.block_size:>16,}  "
              f"{' '.join(out.text.split())[:60]}{same}")
        del llm


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_demo(opts: DemoOptions) -> None:
    t0 = time.perf_counter()
    with DemoServer(opts.engine_kwargs) as server:
        print(f"loaded {server.engine.config.model} in {time.perf_counter() - t0:.1f} s; "
              f"the server answers /health on port {server.port}\n")
        round_one(server, opts)
        round_two(server, opts)
    round_three(opts)
    print(f"\ndemo took {time.perf_counter() - t0:.1f} s")
