"""kvserve: an LLM inference engine built around KV-cache management."""

from kvserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import kvserve` cheap for the CLI and tools.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
