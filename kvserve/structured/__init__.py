"""Structured outputs: what a request asks its output to follow (params.py), the grammars
compiled for it with xgrammar, cached and compiled off the engine step (grammar.py), and the
tool-call grammar of the chat template's format (tool_calls.py)."""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
