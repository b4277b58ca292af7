"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`)
and its error shape.

What the official `anthropic` SDK sends, 0.x and 2.x: the 2.x SDK no longer takes
`temperature`, `top_p` and `top_k` as arguments (it sends them only through `extra_body`, as
older SDKs and other clients send them directly), and adds a request-level `cache_control`
(automatic caching) and `output_config` (`format`: a JSON schema the answer must follow).
kvserve's extensions ride along as they do on chat completions: `cache_salt` and
`kv_cache_report`.

As on the OpenAI endpoints, no field is accepted and ignored: a field kvserve cannot honour
(images and documents for a text model, extended thinking, server tools, `effort`, a container)
is a 400 that names it, and so is a field this module does not know. Content blocks are read
here only as far as their type; serving_messages.py turns each known type into chat messages and
refuses the others by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvserve.frontend.anthropic_errors import anthropic_error, is_anthropic_path
from kvserve.server.protocol import MAX_STOP, error_body


def shaped_error(path: str, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """An error body in the shape the route's clients read: Anthropic's on /v1/messages,
    OpenAI's everywhere else."""
    if is_anthropic_path(path):
        return anthropic_error(status, message)
    return error_body(status, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class Block(BaseModel):
    """A content block as far as its type: the rest is read by the converter of that type
    (serving_messages.py), which refuses the types kvserve does not serve."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Optional[str] = None  # a custom tool may leave it out


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class Tool(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Strict):
    type: str
    budget_tokens: Optional[int] = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None


class MessagesMetadata(_Strict):
    user_id: Optional[str] = None


class _Prompt(_Strict):
    """What both endpoints read: the conversation, the system prompt and the tools."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Optional[Union[str, list[Block]]] = None
    tools: Optional[list[Block]] = None  # each read as a Tool unless a server tool's type
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    cache_salt: Optional[str] = None  # kvserve's extension, as on chat completions


class MessagesRequest(_Prompt):
    max_tokens: Annotated[int, Field(ge=0)]  # 0: fill the cache, answer nothing (Anthropic's)
    stop_sequences: Optional[Annotated[list[Annotated[str, Field(min_length=1)]],
                                       Field(max_length=MAX_STOP)]] = None
    stream: Optional[bool] = False
    temperature: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    metadata: Optional[MessagesMetadata] = None
    cache_control: Optional[CacheControl] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    output_config: Optional[OutputConfig] = None
    kv_cache_report: Optional[bool] = False


class CountTokensRequest(_Prompt):
    cache_control: Optional[CacheControl] = None
    output_config: Optional[OutputConfig] = None
