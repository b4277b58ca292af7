"""SamplingParams: how one request picks its tokens, with vLLM's field names and defaults.

Validation happens in `__post_init__`, so an invalid value is refused when the user builds the
object, long before it could reach the sampler inside a batched step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.retention import Retention, kv_retention_range
from kvserve.structured.params import StructuredOutputsParams
from kvserve.utils.validation import check_utf8, shorten

# vLLM's default max_logprobs: the most top-k alternatives a request may ask for per prompt
# token (the server applies it to logprobs/top_logprobs too).
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value: -100 bans a token in practice, 100 forces it.
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None = up to max_model_len; 0 = prefill only: the prompt is computed (its prompt_logprobs
    # recorded, its blocks cached) and the request finishes with "length", having sampled
    # nothing (what an OpenAI `echo` request with `max_tokens: 0` asks for).
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen one is added)
    # Per prompt token: its logprob and the top-k of the distribution that predicted it (vLLM's
    # prompt_logprobs; 0 = the actual token only). Such a request computes its whole prompt
    # (it takes no prefix-cache hits: a cached block has no hidden states to give logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before the
    # penalties and the temperature (the returned logprobs stay the raw ones).
    logit_bias: dict[int, float] | None = None
    # vLLM's structured outputs (JSON schema, regex, choice, grammar): the sampler only draws
    # tokens the grammar allows, and the request ends when the grammar does. A dict is read
    # as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None
    # kvserve's per-request cache report (kvserve/kv/report.py): cached tokens by source and
    # why the first uncached prompt token missed, in RequestOutput.kv_cache_report.
    kv_cache_report: bool = False
    # False: the report says nothing of what the cache holds beyond this request's own tokens
    # (no cached text of a divergence, no `salt` reason): what the server gives callers who
    # are not its admin (kvserve/server/auth.py). The offline API's user is the operator.
    kv_cache_report_full: bool = True
    # How long and how stubbornly this request's prompt blocks stay cached (kv/retention.py):
    # TensorRT-LLM's retention as a dict ({"priority": 0..100, "ttl": "10m", "num_tokens": n})
    # or a Retention (the server's, from cache_control breakpoints); None: the policy alone.
    kv_retention: Retention | dict | None = None
    # Prefill/decode disaggregation (kv/tiers/transfer.py), vLLM's `kv_transfer_params`:
    # {"do_remote_decode": true} asks a producer to keep the prompt's KV for a consumer (it
    # answers with the params a consumer needs); a producer's answer, given to a consumer,
    # makes it pull the prompt's KV before computing the rest.
    kv_transfer_params: dict | None = None
    # filled by the engine, not the user
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.kv_retention, dict):
            self.kv_retention = Retention((kv_retention_range(self.kv_retention),))
        _require(self.kv_retention is None or isinstance(self.kv_retention, Retention),
                 f"kv_retention must be an object, got {shorten(self.kv_retention)}")
        _require(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict),
                 f"kv_transfer_params must be an object, got {shorten(self.kv_transfer_params)}")
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _require(_is_num(self.temperature) and self.temperature >= 0,
                 f"temperature must be >= 0, got {self.temperature!r}")
        _require(_is_num(self.top_p) and 0 < self.top_p <= 1,
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0,
                 f"top_k must be -1 (disabled) or a non-negative integer, got {self.top_k!r}")
        _require(_is_num(self.min_p) and 0 <= self.min_p <= 1,
                 f"min_p must be in [0, 1], got {self.min_p!r}")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_num(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _require(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
                 f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0,
                 f"min_tokens must be >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _require(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
                 f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        _require(self.prompt_logprobs is None
                 or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                 f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                 f"got {shorten(self.prompt_logprobs)}")
        _require(all(isinstance(s, str) and s for s in self.stop_list),
                 f"stop must be a non-empty string or a list of them, got {shorten(self.stop)}")
        for stop in self.stop_list:
            check_utf8("a stop string", stop)
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict),
                     f"logit_bias must be a dict of token id to bias, got "
                     f"{shorten(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                _require(_is_int(token) and token >= 0,
                         f"logit_bias keys must be token ids (integers >= 0), got {shorten(token)}")
                _require(_is_num(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                         f"logit_bias values must be in [-100, 100], got {shorten(bias)} for "
                         f"token {token}")
        _require(self.structured_outputs is None
                 or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs must be StructuredOutputsParams (or a dict of its fields), "
                 f"got {type(self.structured_outputs).__name__}")
        _require(isinstance(self.kv_cache_report, bool),
                 f"kv_cache_report must be a boolean, got {shorten(self.kv_cache_report)}")
        _require(isinstance(self.kv_cache_report_full, bool),
                 "kv_cache_report_full must be a boolean, got "
                 f"{shorten(self.kv_cache_report_full)}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be non-negative integers, got "
                 f"{shorten(self.stop_token_ids)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
