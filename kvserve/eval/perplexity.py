"""Held-out perplexity through the engine's prompt logprobs, and the references it is read
against: transformers on the same windows (the parity check), a unigram model of the training
tokens and the random-weight model of the same shape (the baselines a trained model must beat).

Every evaluator scores the same tokens: the corpus is one token stream (each file's tokens
followed by the tokenizer's EOS as a document separator) cut into non-overlapping windows of
`context` tokens, and every token of a window but its first is predicted from the tokens before
it in that window. `kvserve bench perplexity` is the command line.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.tokenizer.tokenizer import Tokenizer

# What save_pretrained writes for the weights and the model; everything else in a checkpoint
# directory (the tokenizer's files) is copied next to a re-initialised model.
_MODEL_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


@dataclass(frozen=True)
class NLL:
    """A sum of negative log-likelihoods (nats) over `tokens` predicted tokens."""

    total: float
    tokens: int
    # per window, the most likely next token at each predicted position (engine_nll with
    # top1=True): what a next-token agreement between two engines compares
    top1: tuple[tuple[int, ...], ...] | None = None

    @property
    def per_token(self) -> float:
        return self.total / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.per_token)


def read_text(path: Path) -> str:
    """A file as text; bytes that are not UTF-8 (a few stdlib files are Latin-1) become U+FFFD,
    the same for every evaluator."""
    return path.read_bytes().decode("utf-8", errors="replace")


def corpus_tokens(tokenizer: Tokenizer, files: Iterable[Path], max_tokens: int | None = None
                  ) -> list[int]:
    """The files' tokens in order, each file followed by EOS, stopping once `max_tokens` are
    gathered (so a small budget does not tokenize a whole corpus)."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer.encode(read_text(path), add_special_tokens=False))
        ids.extend(separator)
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def windows(token_ids: Sequence[int], context: int) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens; a last window shorter than 2 tokens
    predicts nothing and is dropped."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    cut = [list(token_ids[i:i + context]) for i in range(0, len(token_ids), context)]
    return [w for w in cut if len(w) >= 2]


def num_predicted(wins: Sequence[Sequence[int]]) -> int:
    return sum(len(w) - 1 for w in wins)


def engine_nll(model_dir: str | Path, wins: Sequence[list[int]], dtype: str = "float32",
               use_tqdm: bool = True, top1: bool = False, **engine_kwargs) -> NLL:
    """The windows' NLL through kvserve: one request per window with prompt_logprobs=0 (only
    the actual tokens' logprobs), so the chunked, batched, paged path is what is measured.
    With `top1`, prompt_logprobs=1 adds each position's most likely token."""
    from kvserve import LLM

    context = max(len(w) for w in wins)
    engine_kwargs.setdefault("max_num_batched_tokens", max(2048, context + 1))
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=context + 1, **engine_kwargs)
    try:
        return llm_nll(llm, wins, use_tqdm, top1)
    finally:
        llm.engine.shutdown()


def llm_nll(llm, wins: Sequence[list[int]], use_tqdm: bool = True, top1: bool = False) -> NLL:
    """engine_nll on an engine already built (`kvserve bench perplexity`'s, from the engine
    flags, a GGUF file as well as a directory); its max_model_len must exceed the windows."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=int(top1),
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": w} for w in wins], params, use_tqdm=use_tqdm)
    total, best = 0.0, []
    for w, out in zip(wins, outputs):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(w)
        total -= sum(entries[i][w[i]] for i in range(1, len(w)))
        if top1:
            best.append(tuple(max(entries[i], key=entries[i].__getitem__)
                              for i in range(1, len(w))))
    return NLL(total, num_predicted(wins), tuple(best) if top1 else None)


def transformers_nll(model_dir: str | Path, wins: Sequence[list[int]], dtype: str = "float32",
                     use_tqdm: bool = True) -> NLL:
    """The same windows through transformers' forward, one window at a time (no padding), the
    log-likelihoods from log_softmax of its logits accumulated in float64."""
    import torch
    import transformers
    from tqdm.auto import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=getattr(torch, dtype))
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for w in tqdm(wins, desc="transformers", unit="window", disable=not use_tqdm):
            ids = torch.tensor([w])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            total -= logprobs.gather(1, ids[0, 1:, None]).double().sum().item()
    return NLL(total, num_predicted(wins))


def unigram_nll(train_tokens: Iterable[int], vocab_size: int, wins: Sequence[list[int]]) -> NLL:
    """A unigram model of the training tokens with add-one smoothing,
    p(t) = (count(t) + 1) / (N + V): what knowing only token frequencies gives."""
    counts = Counter(train_tokens)
    denominator = math.log(sum(counts.values()) + vocab_size)
    total = sum(denominator - math.log(counts[t] + 1) for w in wins for t in w[1:])
    return NLL(total, num_predicted(wins))


def random_weight_copy(model_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """The same config re-initialised by transformers (its own init, seeded) and saved with
    the original tokenizer files: the untrained model of the same shape."""
    import torch
    import transformers

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in _MODEL_FILES \
                and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / abs(b)
