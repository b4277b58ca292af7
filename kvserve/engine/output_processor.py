"""What the user sees of a request: its text (detokenized incrementally where someone looks
before the end), its stop strings, and its RequestOutput.

Why apart from the step loop: text is the user's concern, not the scheduler's or the worker's.
The step loop finishes a request on token-level stops (EOS, stop token ids, length) and asks
here whether a stop string has ended it; everything a RequestOutput carries is built here
from the requests' counters. (vLLM v1's OutputProcessor, which the frontend runs.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop
from kvserve.utils.validation import shorten


@dataclass
class _Detok:
    """Per-sample text state: the incremental decoder and the text cut at a stop string."""

    decoder: IncrementalDetokenizer
    text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _Detok] = {}  # by sample id: those decoded token by token

    def __len__(self) -> int:
        """The samples whose text is held (per-request state: 0 when nothing runs)."""
        return len(self._texts)

    def track(self, request: Request, stream: bool) -> None:
        """Text is decoded token by token only when someone looks at it before the end (stop
        strings, streaming); otherwise once, at the end, off the per-token path."""
        params = request.sampling_params
        if params.detokenize and (stream or params.stop_list):
            self._texts[request.request_id] = _Detok(IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens))

    def forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def stop_string(self, request: Request, token: int, num_output: int | None = None) -> bool:
        """Add the sampled token to the request's text; whether a stop string has ended it
        (the text is cut there, `stop_reason` set). `num_output`: the output tokens up to and
        including this one, when later ones are appended already (speculative decoding)."""
        detok = self._texts.get(request.request_id)
        if detok is None:
            return False
        params = request.sampling_params
        delta = detok.decoder.add(token)
        detok.text += delta
        if num_output is None:
            num_output = request.num_output_tokens
        if not params.stop_list or num_output < params.min_tokens:
            return False
        at = find_stop(detok.text, len(delta), params.stop_list)
        if at is None:
            return False
        stop = next(s for s in params.stop_list if detok.text.startswith(s, at))
        cut = at + len(stop) if params.include_stop_str_in_output else at
        detok.text = detok.text[:cut]
        request.stop_reason = stop
        return True

    def output(self, parent_id: str, children: list[Request]) -> RequestOutput:
        """The request's output now (its final one once every sample has finished: the text
        state is let go then)."""
        finished = all(c.finished for c in children)
        completions = []
        for c in children:
            detok = self._texts.pop(c.request_id, None) if finished else \
                self._texts.get(c.request_id)
            if detok is not None:
                if finished and c.stop_reason is None:  # text ended mid-character: emit the rest
                    detok.text += detok.decoder.flush()
                text = detok.text
            elif c.sampling_params.detokenize:
                text = self.tokenizer.decode(c.output_token_ids,
                                             skip_special_tokens=c.sampling_params.skip_special_tokens)
            else:
                text = ""
            wants_logprobs = c.sampling_params.logprobs is not None
            completions.append(CompletionOutput(
                index=c.index, text=text, token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if wants_logprobs else None,
                logprobs=list(c.output_logprobs) if wants_logprobs else None,
                finish_reason=c.status.value if c.finished else None,
                stop_reason=c.stop_reason))
        first = children[0]
        prompt_logprobs = _prompt_logprobs(first)
        return RequestOutput(request_id=parent_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=_group_metrics(children, finished),
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs,
                             prompt_logprob_ranks=None if prompt_logprobs is None
                             else list(first.prompt_logprob_ranks),
                             kv_cache_report=None if first.cache_report is None
                             else self.report_dict(first))

    def report_dict(self, request: Request) -> dict:
        """The request's cache report as RequestOutput carries it (texts decoded once)."""
        report = request.cache_report
        if not isinstance(report, dict):
            report = request.cache_report = report.to_dict(self.tokenizer.decode)
        return report

    def error_output(self, parent_id: str, children: list[Request],
                     exc: Exception) -> RequestOutput:
        """The final output of a request that failed (finish_reason "error" on every sample),
        built from the counters alone, since its text is what may have failed."""
        for c in children:
            self.forget(c.request_id)
        first = children[0]
        return RequestOutput(
            request_id=parent_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[CompletionOutput(index=c.index, text="", token_ids=c.output_token_ids,
                                      cumulative_logprob=None, logprobs=None,
                                      finish_reason=RequestStatus.FINISHED_ERROR.value)
                     for c in children],
            finished=True, metrics=_group_metrics(children, True),
            num_cached_tokens=first.num_cached_tokens,
            kv_cache_report=None if first.cache_report is None else self.report_dict(first),
            error=shorten(f"{type(exc).__name__}: {exc}", 200))


def _prompt_logprobs(first: Request) -> list[dict[int, float] | None] | None:
    """vLLM's RequestOutput.prompt_logprobs, once every prompt token has its entry (a streamed
    output of a sibling sample can come before the first sample's prefill ends)."""
    if len(first.prompt_logprobs) < len(first.prompt_token_ids):
        return None
    return list(first.prompt_logprobs)


def _group_metrics(children: list[Request], finished: bool) -> RequestMetrics:
    """The metrics of a request from those of its samples."""
    first = children[0]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min((c.first_token_time for c in children
                              if c.first_token_time is not None), default=None),
        last_token_time=max((c.last_token_time for c in children
                             if c.last_token_time is not None), default=None),
        finished_time=max((c.finished_time or 0.0 for c in children), default=None)
        if finished else None,
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(c.num_preemptions for c in children),
        num_draft_tokens=sum(c.num_draft_tokens for c in children),
        num_accepted_tokens=sum(c.num_accepted_tokens for c in children))
