"""Tool calls: the chat template's own format, and the JSON a forced `tool_choice` is held to.

The Hermes / Qwen2.5 chat templates write a call as
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`; with `tool_choice` "auto" the
model is free and `kvserve.server.tool_parser` reads such blocks back.

A forced `tool_choice` constrains the output to JSON only, as vLLM does (its
`get_json_schema_from_tools`), never to the template's wrapper: the tags and the loose
whitespace around them cost tokens that a short `max_tokens` cannot spare, and a wrapper cut
short is no call at all.

* a named function: the output is that function's arguments, the `parameters` schema itself;
* "required": the output is a JSON array of calls `{"name": NAME, "arguments": {...}}`, one or
  more (exactly one with `parallel_tool_calls` false). vLLM's items are `{"name", "parameters"}`;
  kvserve writes "arguments", the key the templates' own calls use.

The server compiles these with `disable_any_whitespace` (`kvserve.structured.grammar`): no
whitespace but one space after each "," and ":", as `json.dumps` writes JSON.
"""

from __future__ import annotations

from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point at


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema (OpenAI: omitted `parameters` means an empty list of
    them, which any JSON object satisfies here)."""
    return function.get("parameters") or {"type": "object"}


def required_calls_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of the output `tool_choice` "required" forces: an array of one or more calls
    (at most one unless `parallel`), each a name among the functions' and arguments valid
    against that function's parameters. Each function's `$defs` move to the root, where the
    `#/$defs/...` references inside its parameters point once the parameters are nested; two
    functions defining one name differently are a ValueError (so is vLLM's)."""
    defs: dict[str, dict[str, Any]] = {}
    options = []
    for fn in functions:
        params = dict(parameters_schema(fn))
        for key in _DEFS_KEYS:
            for name, schema in (params.pop(key, None) or {}).items():
                where = defs.setdefault(key, {})
                if where.get(name, schema) != schema:
                    raise ValueError(f"tools define {key} {name!r} twice, differently")
                where[name] = schema
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema
