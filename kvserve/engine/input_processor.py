"""A request from what the user sent: validated, tokenized, its limits resolved, before it
reaches the scheduler.

Why apart from the step loop: this is the one place where a request is validated, so that
nothing malformed ever reaches a batched step (an invalid request raises here, before it is
queued, and holds no blocks); it reads the model's limits and the KV pool's size, never the
step's state. The server calls the same checks from its worker threads (grammar compiles run
off the engine loop). vLLM v1's InputProcessor draws the same line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Union

from kvserve.utils import features as F
from kvserve.blend.parts import check_spans, tokenize_parts
from kvserve.config import EngineConfig
from kvserve.kv.bounded import (
    ATTENTION_POLICIES,
    BoundedKV,
    BoundedKVConfig,
    resolve_bounded_kv,
)
from kvserve.kv.manager import KVCacheManager
from kvserve.attention.base import AttentionBackend
from kvserve.models.config import ModelConfig
from kvserve.request import Request
from kvserve.sampling import SamplingParams
from kvserve.structured.compiler import GrammarCompiler
from kvserve.tokenizer.tokenizer import Tokenizer
from kvserve.utils.validation import check_cache_salt, check_text_fits, check_token_ids, check_utf8, \
    shorten

# A prompt is text, {"prompt": text}, or {"prompt_token_ids": [...]} (vLLM's TokensPrompt).
PromptType = Union[str, Mapping[str, Any]]


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                 kv: KVCacheManager, kv_differs_from_model: bool,
                 backend: AttentionBackend) -> None:
        """`kv_differs_from_model`: the KV cache is quantized or in another dtype than the
        model (bounded caches refuse it); `backend`: asked whether it returns attention
        weights (SnapKV and H2O need them)."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.kv = kv
        self._backend = backend
        # What the model turns on (kvserve/utils/features.py), for the table's rows a bounded cache
        # meets: MLA, sliding windows, a KV cache in another dtype, per-group tables.
        self._features, self._feature_context = F.model_features(model_config,
                                                                 kv_differs_from_model)
        if kv.num_groups > 1:
            self._features.add(F.HYBRID)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        # Requests whose grammar is still compiling (off the engine loop): parent id -> (the
        # compile, its samples); aborting one cancels its wait (the compile stops with no
        # request left waiting). The engine queues them once it is done; the batch never
        # waits for a compile.
        self.compiling: dict[str, tuple[Future, list[Request]]] = {}
        self._grammars_lock = threading.Lock()
        # The engine-wide bounded KV cache (lossy, opt-in), checked now so a bad one fails at
        # start-up; a request may ask for its own (add_request's bounded_kv).
        self.bounded_kv: BoundedKV | None = None
        if config.bounded_kv_policy is not None:
            self.bounded_kv = self.resolve_bounded_kv(BoundedKVConfig(
                config.bounded_kv_policy, config.bounded_kv_budget,
                config.bounded_kv_sink_tokens, config.bounded_kv_observation_window))

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler, made on first use (building the tokenizer's
        table takes a moment; an engine that never sees a grammar never pays it). Thread-safe:
        the server compiles from worker threads, off the engine loop."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                    workers=self.config.structured_outputs_compile_workers,
                    compile_timeout=self.config.structured_outputs_compile_timeout,
                    max_schema_bytes=self.config.structured_outputs_max_schema_bytes)
            return self._grammars

    def take_compiled(self) -> list[tuple[str, list[Request], Future]]:
        """The held requests whose compile is done (failed or not), no longer held."""
        done = [(parent, children, grammar)
                for parent, (grammar, children) in self.compiling.items() if grammar.done()]
        for parent, _, _ in done:
            del self.compiling[parent]
        return done

    def wait_compiling(self, timeout: float) -> None:
        wait([f for f, _ in self.compiling.values()], timeout=timeout,
             return_when=FIRST_COMPLETED)

    def with_grammar(self, children: list[Request], grammar: Future | None) -> list[Request]:
        """The samples, each with its own matcher over the compiled grammar if there is one."""
        if grammar is not None:
            for child in children:
                child.grammar = self.grammars.new_state(grammar.result())
        return children

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

    def make_requests(self, prompt: PromptType, params: SamplingParams | None,
                      request_id: str, arrival_time: float | None, cache_salt: str | None,
                      priority: int, bounded_kv: BoundedKVConfig | None
                      ) -> tuple[list[Request], Future | None]:
        """The request's samples (n of them), and its grammar's compile (None without one);
        raises ValueError (or the grammar's error, if its compile failed at once) if the
        request is bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if cache_salt is None and isinstance(prompt, Mapping):
            cache_salt = prompt.get("cache_salt")  # vLLM's TextPrompt / TokensPrompt field
        check_cache_salt(cache_salt)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {shorten(priority)}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        check_token_ids("logit_bias token ids", list(params.logit_bias or ()),
                        self.model_config.vocab_size)
        documents: tuple[tuple[int, int], ...] = ()
        if isinstance(prompt, Mapping) and "prompt_parts" in prompt:  # kvserve/blend/parts.py
            parts = tokenize_parts(self.tokenizer, prompt["prompt_parts"], lambda text:
                                   check_text_fits(self.tokenizer, text,
                                                   self.config.max_model_len))
            text, token_ids, documents = parts.text, parts.token_ids, parts.documents
        else:
            text, token_ids = self._tokenize(prompt)
            if isinstance(prompt, Mapping) and prompt.get("documents") is not None:
                documents = check_spans(prompt["documents"], len(token_ids))
        grammar: Future | None = None
        if params.structured_outputs is not None:
            grammar = self.grammars.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        bound = self.resolve_bounded_kv(bounded_kv) if bounded_kv is not None \
            else self.bounded_kv
        blocks = self._blocks_needed(len(token_ids), max_tokens, bound)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {blocks} KV blocks ({len(token_ids)} prompt + {max_tokens} "
                f"new tokens) but the KV pool has only {self.kv.num_blocks} blocks "
                f"({self.kv.num_blocks * self.config.block_size} tokens); raise "
                "kv_cache_memory_bytes or lower max_tokens")
        arrival = time.time() if arrival_time is None else arrival_time
        children = [Request(request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                            prompt_token_ids=token_ids, sampling_params=params,
                            max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                            arrival_time=arrival, prompt=text, index=i, parent_id=request_id,
                            cache_salt=cache_salt, priority=priority, bounded_kv=bound,
                            documents=documents)
                    for i in range(params.n)]
        return children, grammar

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_utf8("the prompt", prompt)
            check_text_fits(self.tokenizer, prompt, self.config.max_model_len)
            text, ids = prompt, (self.tokenizer.encode(prompt) if prompt else [])
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of integers")
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(f"prompt must be a string, got {type(text).__name__}")
                check_utf8("the prompt", text)
            ids = list(ids)
            check_token_ids("token ids", ids, self.model_config.vocab_size)
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        else:
            raise ValueError("a prompt must be a string, {'prompt': str}, "
                             "{'prompt_token_ids': [...]} or {'prompt_parts': [...]}, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        return text, ids

    def resolve_bounded_kv(self, config: BoundedKVConfig) -> BoundedKV:
        if not isinstance(config, BoundedKVConfig):
            raise ValueError(f"bounded_kv must be a BoundedKVConfig, got "
                             f"{type(config).__name__}")
        on = self._features | {F.BOUNDED}
        if config.policy in ATTENTION_POLICIES:
            on.add(F.BOUNDED_BY_ATTENTION)
        if not self._backend.observes_attention:  # asked now: a backend may say so late
            on.add(F.NO_ATTENTION_WEIGHTS)
        self.config.check_features(on, policy=config.policy, **self._feature_context)
        return resolve_bounded_kv(config, self.config.max_model_len,
                                  self.model_config.layer_windows)

    def _blocks_needed(self, prompt_len: int, max_tokens: int, bound: BoundedKV | None) -> int:
        """The most blocks a request can hold at once: what the manager counts (all its tokens,
        or its window's), or for a bounded cache its prompt, or budget + one block plus the
        budget's fresh blocks while it compacts. Its tokens are those whose KV is ever
        computed: the last sampled token never is (the simulator counts the same)."""
        total = prompt_len + max(max_tokens - 1, 0)
        if bound is None:
            return self.kv.peak_blocks(prompt_len, total)
        return bound.most_blocks(prompt_len, total, self.config.block_size)

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.config.max_model_len
        assert limit is not None
        if params.max_tokens == 0:  # prefill only: the prompt may fill the whole context
            if prompt_len > limit:
                raise ValueError(f"the prompt has {prompt_len} tokens, but max_model_len is "
                                 f"{limit}")
            return 0
        if prompt_len >= limit:
            raise ValueError(f"the prompt has {prompt_len} tokens, but max_model_len is {limit}: "
                             "no room to generate")
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens, but "
                             f"{prompt_len} prompt tokens + {params.max_tokens} max_tokens "
                             f"= {prompt_len + params.max_tokens} were requested")
        return params.max_tokens
