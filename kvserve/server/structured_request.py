"""What a request's structured-output and tool fields ask for, checked and turned into engine
terms: a `StructuredOutputsParams` (response_format, vLLM's structured_outputs, or the JSON that
tool_choice "required" / a named function imposes: kvserve.structured.tool_calls) and a
`ToolPlan` (whether and how the output is read for tool calls, and how many may be kept). Every
malformed or unsupported value is an APIError 400 that names its field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.server.protocol import APIError
from kvserve.server.tool_parser import (ForcedToolCalls, ToolCallStream, assemble,
                                        parse_tool_calls)
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.tool_calls import parameters_schema, required_calls_schema
from kvserve.utils.validation import shorten

# vLLM's names before 0.12 (which removed them) -> the structured_outputs key that replaced them.
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                 "guided_decoding_backend": None}


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The constraint a request's response_format / structured_outputs asks for, or None."""
    for old, new in LEGACY_FIELDS.items():
        if getattr(req, old, None) is not None:
            hint = (f'use "structured_outputs": {{"{new}": ...}}' if new
                    else "remove it (kvserve has one backend, xgrammar)")
            raise APIError(400, f"{old} was removed in vLLM 0.12 and is not supported: {hint}",
                           param=old)
    from_format = _response_format(req.response_format)
    if req.structured_outputs is not None:
        if from_format is not None:
            raise APIError(400, "give response_format or structured_outputs, not both",
                           param="structured_outputs")
        try:
            return StructuredOutputsParams.from_dict(req.structured_outputs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None
    return from_format


def _response_format(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON "
                           "schema object", param="response_format")
        return StructuredOutputsParams(json=schema)
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got "
                   f"{shorten(kind)}", param="response_format")


@dataclass
class ToolPlan:
    """How a chat request's tools shape its output."""

    parse: bool = False  # look for tool calls in the output
    max_calls: int | None = None  # parallel_tool_calls false: keep the first call only
    grammar: StructuredOutputsParams | None = None  # required / named: the forced format
    named: str | None = None  # a named tool_choice: the output is this function's arguments
    required: tuple[str, ...] = ()  # "required": the output is an array of calls to these

    def parser(self) -> ToolCallStream | ForcedToolCalls:
        """A streaming reader of one choice's output."""
        if self.named is not None or self.required:
            return ForcedToolCalls(self.named, self.required)
        return ToolCallStream()

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished choice's (content, `message.tool_calls`)."""
        if self.named is None and not self.required:
            content, calls = parse_tool_calls(text)
            return content or None, [call.to_openai() for call in calls[:self.max_calls]]
        content, events = self.parser().feed(text, final=True)
        return content or None, assemble(events)


def tool_plan(req, structured: StructuredOutputsParams | None) -> ToolPlan:
    if req.functions is not None or req.function_call is not None:
        field = "functions" if req.functions is not None else "function_call"
        raise APIError(400, f"{field} is deprecated by OpenAI and not supported here: use tools "
                       "and tool_choice", param=field)
    functions = _functions(req.tools)
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a function, got "
                           f"{shorten(choice)}", param="tool_choice")
        if choice == "none":
            return ToolPlan()
        if not functions:
            raise APIError(400, f"tool_choice {choice} needs tools", param="tool_choice")
        forced = functions if choice == "required" else None
    else:
        name = (choice.get("function") or {}).get("name") \
            if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'a named tool_choice is {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
        forced = [f for f in functions if f["name"] == name]
        if not forced:
            raise APIError(400, f"tool_choice names {shorten(name)}, which is not in tools",
                           param="tool_choice")
        parallel = False
    plan = ToolPlan(parse=True, max_calls=None if parallel else 1)
    if forced is not None:
        if structured is not None:
            raise APIError(400, "tool_choice required or a named function cannot be combined "
                           "with response_format or structured_outputs", param="tool_choice")
        if choice == "required":
            plan.required = tuple(f["name"] for f in forced)
            try:
                schema = required_calls_schema(forced, parallel)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tools") from None
        else:
            plan.named, schema = forced[0]["name"], parameters_schema(forced[0])
        plan.grammar = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return plan


def _functions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": '
                           '{"name": ..., "parameters": {...}}}', param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        out.append(fn)
    return out


def history_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, for the chat template: arguments as objects (OpenAI
    sends them as JSON text; the templates write them with tojson)."""
    out = []
    for call in calls:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"messages[{index}].tool_calls needs function.name",
                           param="messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(400, f"messages[{index}].tool_calls: arguments are not valid "
                               "JSON", param="messages") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out
