"""The tiny windowed models and greedy settings that tests/test_window_memory.py and
tests/test_hybrid_memory.py both build their checkpoints from (config keyword arguments for
transformers' Mistral / Qwen2 / Gemma 3 configs)."""

import torch
from helpers import kv_bytes_per_token, random_prompts

from kvserve import LLM, SamplingParams

VOCAB = 256
WINDOW = 32
NEW_TOKENS = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
               bos_token_id=0, eos_token_id=2, pad_token_id=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(lengths, seed=0):
    return random_prompts(lengths, VOCAB, seed)


def window_llm(path, **kwargs) -> LLM:
    """An fp32 engine over `path`; `num_blocks` sizes the pool in blocks of every layer (the
    keep-everything unit), whatever layout the engine then picks."""
    blocks = kwargs.pop("num_blocks", None)
    if blocks is not None:
        kwargs["kv_cache_memory_bytes"] = blocks * kwargs["block_size"] * kv_bytes_per_token(path)
    return LLM(model=str(path), dtype="float32", max_model_len=512, **kwargs)


def watch_tables(llm: LLM, poison: bool) -> dict[str, list[list[int]]]:
    """Before every step: fill the free blocks of every slot tensor with NaN (if `poison`);
    after it: record each running request's tables. Returns {request id: its per-group tables
    after its last step}. A block leaving the free list is zeroed when it first shows up in a
    table (the backends read the unwritten tail of a last block under a zero weight)."""
    engine = llm.engine
    tables: dict[str, list[list[int]]] = {}
    poisoned: set[int] = set()
    forward = engine.runner.forward

    def fill(blocks, value):
        if blocks:
            idx = torch.tensor(sorted(blocks), dtype=torch.long)
            for tensors in engine.tensors.storage():
                for t in tensors:
                    t[idx] = value

    def wrapped(seqs, *args, **kwargs):
        if poison:
            taken = {b for s in seqs for t in s.block_tables for b in t} & poisoned
            fill(taken, 0.0)
            poisoned.difference_update(taken)
            free = set(engine.kv.pool._free)
            fill(free - poisoned, float("nan"))
            poisoned.update(free)
        out = forward(seqs, *args, **kwargs)
        for s in seqs:
            tables[s.request_id] = [list(t) for t in s.block_tables]
        return out

    engine.runner.forward = wrapped
    return tables
