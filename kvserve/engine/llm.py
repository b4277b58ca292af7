"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.utils.logging_setup import init_logging
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams

Message = dict[str, Any]


class LLM:
    """Run many prompts through one engine and return their outputs in input order."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        init_logging()
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """A prompt may carry `cache_salt` ({"prompt": ..., "cache_salt": ...}) as in vLLM;
        `priority` (one per prompt, higher = kept longer) feeds the "priority" eviction policy."""
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]  # one prompt; add_request says what is wrong with a bad one
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        for p in params:  # an invalid schema, regex or grammar: refused before anything runs
            if p.structured_outputs is not None:
                self.engine.grammars.compile(p.structured_outputs)
        ids: list[str] = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(prompt, p, priority=prio))
        except Exception:
            for rid in ids:  # refuse the whole call, leaving nothing queued
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (`tools`, as
        in vLLM, go to the template; the output is not parsed for calls here)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(
            tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **(chat_template_kwargs or {})),
            add_special_tokens=False)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt",
                   disable=not use_tqdm, dynamic_ncols=True)
        wanted = set(ids)
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]
