"""The tool-call format of the Hermes / Qwen2.5 chat templates, as a grammar.

A call is written `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, calls one
after another separated by a newline. For `tool_choice` "required" or a named function the
server constrains the whole output to one call (or, with `parallel_tool_calls`, one or more),
whose arguments follow the function's `parameters` schema; `kvserve.server.tool_parser` reads
the same format back.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def tool_calls_source(functions: list[dict[str, Any]], parallel: bool) -> str:
    """The canonical text of a tool-call grammar (what StructuredOutputsParams.tool_calls holds
    and the compile cache keys on): the functions' names and parameter schemas."""
    tools = [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}
             for f in functions]
    return json.dumps({"tools": tools, "parallel": bool(parallel)}, sort_keys=True)


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call's object: a name among the tools' and its arguments."""
    options = [{"type": "object",
                "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_call_grammar(source: dict[str, Any], any_whitespace: bool = True,
                      max_whitespace_cnt: int | None = None):
    """The xgrammar Grammar for `source` (see `tool_calls_source`)."""
    import xgrammar as xgr

    schema = json.dumps(call_schema(source["tools"]))
    body = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                            max_whitespace_cnt=max_whitespace_cnt))
    body = re.sub(r"\broot\b", "kvserve_call_json", body)
    repeat = ' ("\\n" kvserve_call)*' if source.get("parallel") else ""
    head = (f"root ::= kvserve_call{repeat}\n"
            f'kvserve_call ::= "{TOOL_CALL_START}\\n" kvserve_call_json "\\n{TOOL_CALL_END}"\n')
    return xgr.Grammar.from_ebnf(head + body)
