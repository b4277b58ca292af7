"""Request bodies of the OpenAI-compatible API (pydantic v2), and the error shape.

The models are strict (a string is not a number, a number is not a string) and refuse
non-finite floats, so that every malformed body is a 400 before it reaches the engine. The
ranges of the sampling fields are repeated here so that the OpenAPI schema documents them; the
checks that need the model (prompt length against max_model_len, token ids against the
vocabulary) and cache_salt's rules stay in `LLMEngine.add_request`, and `SamplingParams`
re-checks everything: their ValueError is a 400 too. Some bounds are the server's own (how many
samples, how many logprobs, the seed's width, how many stop strings).

No field is accepted and ignored (tests/test_api_fields.py walks every field of every model
here): each one is either honoured or refused with a 400 that names it, and so is a field this
module does not know (OpenAI's behaviour; vLLM would log a warning and go on, which lets a
misspelt option pass unnoticed). As in OpenAI's API, JSON null in an optional field means its
default (the SDK sends null for an argument passed as None); only completions' `max_tokens`
gives null a meaning of its own (vLLM's: up to the context length).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.sampling import MAX_LOGPROBS

# Limits of this server (MAX_LOGPROBS is vLLM's max_logprobs default; OpenAI caps n at 128).
MAX_N = 128
MAX_STOP = 16
MAX_PROMPTS = 2048  # prompts in one /v1/completions request
MAX_LOGIT_BIAS_ENTRIES = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
MaxTokens = Annotated[int, Field(ge=1)]
StopString = Annotated[str, Field(min_length=1)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]
# OpenAI's metadata: "Set of 16 key-value pairs ... Keys are strings with a maximum length of 64
# characters. Values are strings with a maximum length of 512 characters."
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]
# OpenAI's service tiers (its SDK's Literal, 2026: "fast" is priority processing's new name).
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]

# Fields to which null does not mean "the default" (see the module docstring).
_NULL_IS_MEANINGFUL = frozenset({"max_tokens"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @model_validator(mode="after")
    def _null_means_default(self):
        """JSON null in an optional field is its default (OpenAI's rule), so that every handler
        sees one value per meaning."""
        for name, info in type(self).model_fields.items():
            if getattr(self, name) is None and info.default is not None \
                    and name not in _NULL_IS_MEANINGFUL:
                object.__setattr__(self, name, info.get_default(call_default_factory=True))
        return self


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingFields(_Strict):
    """Fields common to both endpoints (OpenAI's, then vLLM's extensions)."""

    model: Optional[str] = None
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = 1
    temperature: Optional[Annotated[float, Field(ge=0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    seed: Optional[Seed] = None
    stop: Optional[Union[StopString, Annotated[list[StopString],
                                               Field(max_length=MAX_STOP)]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[LogitBias] = None
    # vLLM's extra sampling parameters
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None
    min_p: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0)]] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[Annotated[int, Field(ge=0)]] = 0
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=1024)]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    cache_salt: Optional[str] = None
    priority: Optional[int] = 0
    prompt_logprobs: Optional[NumLogprobs] = None
    # kvserve's cache report (kvserve/kv/report.py): a top-level `kv_cache_report` object
    kv_cache_report: Optional[bool] = False
    # Retention (kvserve/server/cache_control.py): TensorRT-LLM's {"priority", "ttl",
    # "num_tokens"}, and Anthropic's {"type": "ephemeral", "ttl": "5m" | "1h"} for the prompt
    kv_retention: Optional[dict[str, Any]] = None
    cache_control: Optional[dict[str, Any]] = None
    # Prefill/decode disaggregation (vLLM's field, kvserve/kv/tiers/transfer.py)
    kv_transfer_params: Optional[dict[str, Any]] = None
    # Structured outputs: OpenAI's response_format (text, json_object, json_schema) and vLLM's
    # structured_outputs {json, regex, choice, grammar, json_object, ...}; at most one of them.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's names before 0.12, which removed them: refused with a 400 naming the new field.
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict[str, Any]] = None  # a breakpoint at its message's end
    # (or {"type": "document"}: a reusable document, server/documents.py)


class CompletionRequest(_SamplingFields):
    prompt: Union[Annotated[str, Field(min_length=1)],
                  Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)],
                  # one prompt as text parts, some marked as documents (server/documents.py)
                  Annotated[list[TextPart], Field(min_length=1)]]
    # 0 is allowed with echo or prompt_logprobs (score the prompt, generate nothing)
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = 16
    logprobs: Optional[NumLogprobs] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(_Strict):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    # Anthropic's breakpoint: the prompt up to this message's end is kept for the TTL
    cache_control: Optional[dict[str, Any]] = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[MaxTokens] = None
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[NumLogprobs] = None
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # tool calling (kvserve/server/structured_request.py: tool_plan)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's deprecated forms of tools / tool_choice: refused with a 400 naming the new ones.
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    # OpenAI's stored completions and service tiers (chat only, as OpenAI has them): metadata is
    # checked and echoed, store=true stores nothing (as in vLLM), service_tier's answer is
    # "default" (kvserve/server/serving_chat.py says why).
    metadata: Optional[Metadata] = None
    store: Optional[bool] = False
    service_tier: Optional[ServiceTier] = None


class _CachePrompt(_Strict):
    """A /v1/cache request's prompt: a prompt (as /v1/completions takes one) or chat messages
    (as /v1/chat/completions renders them), and the salt its blocks are cached under."""

    model: Optional[str] = None
    prompt: Optional[Union[Annotated[str, Field(min_length=1)],
                           Annotated[list[TokenId], Field(min_length=1)]]] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    cache_salt: Optional[str] = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class CacheExplainRequest(_CachePrompt):
    """POST /v1/cache/explain: what decides a prompt's cache lookup, without running it."""

    add_generation_prompt: Optional[bool] = True
    prompt_logprobs: Optional[NumLogprobs] = None


class CachePinRequest(_CachePrompt):
    """POST /v1/cache/pin: a prompt whose KV stays on the device until DELETE
    /v1/cache/pin/{id}. Messages are rendered without a generation prompt by default: what
    later requests share is the conversation so far."""

    add_generation_prompt: Optional[bool] = False


# -- errors ---------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          403: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    """Raised by handlers; rendered as OpenAI's {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return APIError(status, message, param=param, code=code).body()
