"""StructuredOutputsParams: vLLM's request-level description of a constrained output.

Exactly one kind is set: `json` (a JSON schema, dict or string), `regex`, `choice` (the output is
one of these strings), `grammar` (EBNF, in xgrammar's dialect of GBNF, or Lark) or `json_object`
(any JSON object). (A forced `tool_choice` is a `json` schema with `disable_any_whitespace`:
kvserve.structured.tool_calls.) The check here is only of shapes; whether a
schema, regex or grammar is valid is the grammar library's call, made when it compiles
(`kvserve.structured.grammar`), and its reason is the error message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvserve.utils.validation import shorten

# Fields vLLM's StructuredOutputsParams has that kvserve refuses, with why.
_REFUSED = {
    "whitespace_pattern": "whitespace_pattern is not supported (use disable_any_whitespace)",
    "structural_tag": "structural_tag is not supported (use tools with tool_choice)",
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's flag; False (its default) allows whitespace between JSON tokens, at most
    # MAX_JSON_WHITESPACE characters of it in a row so that any model ends its JSON.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        kinds = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None] + ["json_object"] * bool(self.json_object)
        if len(kinds) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar, json_object; got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), "
                             f"got {type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise ValueError("structured_outputs.json must be a JSON object (a schema)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {shorten(value)}")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {shorten(self.choice)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StructuredOutputsParams":
        """From a request's `structured_outputs` object (vLLM's names); unknown keys and the
        ones kvserve does not implement are refused by name."""
        if not isinstance(data, dict):
            raise ValueError("structured_outputs must be an object")
        data = {k: v for k, v in data.items() if v is not None}
        for key in data:
            if key in _REFUSED:
                raise ValueError(f"structured_outputs.{key}: {_REFUSED[key]}")
            if key not in ("json", "regex", "choice", "grammar", "json_object",
                           "disable_any_whitespace", "disable_fallback",
                           "disable_additional_properties"):
                raise ValueError(f"structured_outputs has no field {shorten(key)}")
        if data.pop("disable_additional_properties", False):
            raise ValueError("structured_outputs.disable_additional_properties is not supported:"
                             " state additionalProperties in the schema")
        data.pop("disable_fallback", None)  # one backend: there is never a fallback
        return cls(**data)

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @cached_property
    def spec(self) -> tuple[str, str, bool]:
        """The grammar's canonical description: its kind, its text (a schema as sorted,
        compact JSON) and the whitespace flag. Two requests with equal specs share a compile.
        Computed once (a big schema's JSON is not free)."""
        value = getattr(self, self.kind) if self.kind != "json_object" else ""
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif isinstance(value, str) and self.kind == "json":
            value = json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        elif isinstance(value, (list, tuple)):
            value = json.dumps(list(value))
        return self.kind, value, self.disable_any_whitespace

    def key(self) -> str:
        """What identifies the compiled grammar (the compile cache's key): a SHA-256 of the
        spec, so that a megabyte of schema is not a megabyte of dict key."""
        return hashlib.sha256(json.dumps(self.spec).encode()).hexdigest()

    def size(self) -> int:
        """Bytes of the grammar's text (a schema as compact JSON), which the server bounds."""
        return len(self.spec[1].encode())
