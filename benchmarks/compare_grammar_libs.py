#!/usr/bin/env python
"""xgrammar vs llguidance vs outlines-core on kvserve's tokenizers: the figures behind the
choice of structured-output library (docs/structured_output.md).

For each library and each tokenizer (the shipped stdlib-coder, 8,192 entries, and the tiny
random Qwen2's, both byte-level BPE from `tokenizers`) it measures, in one run:

* tokenizer set-up time (once per model),
* compile time of a JSON schema (nested object, array, enum, bounded numbers, required fields),
* the per-token mask time while walking a valid document's tokens (median),
* correctness: every token of a valid document is allowed at its position and the grammar
  accepts at its end; random walks over the allowed tokens (forced to end within a budget)
  produce JSON that `jsonschema` validates.

    .venv/bin/python benchmarks/compare_grammar_libs.py [--walks 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402
import torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "number"},
                                                  "y": {"type": "number"}},
                "required": ["x", "y"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "pos"],
    "additionalProperties": False,
}
DOC = {"name": "Rex", "age": 7, "kind": "dog", "tags": ["a", "bc"], "pos": {"x": 1.5, "y": -2}}


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


def hf_tokenizer(model_dir: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> torch.Tensor:
        bm = self.xgr.allocate_token_bitmask(1, self.vocab)
        m.fill_next_token_bitmask(bm)
        return bm

    def allowed(self, bm: torch.Tensor) -> torch.Tensor:
        return unpack(bm, self.vocab)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class XGrammarStrictStrings(XGrammar):
    """xgrammar as kvserve uses it: its grammar with control characters kept out of
    length-bounded strings (kvserve.structured.grammar.strict_json_strings)."""

    name = "xgrammar+fix"

    def compile(self, schema: dict):
        from kvserve.structured.grammar import strict_json_strings

        grammar = self.xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        return self.compiler.compile_grammar(strict_json_strings(grammar))


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False,
                                          "item_separator": ", ", "key_separator": ": "})
        m = self.ll.LLMatcher(self.tok, grammar)  # llguidance compiles lazily, per matcher
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def mask(self, m) -> torch.Tensor:
        bm = self.llt.allocate_token_bitmask(1, self.vocab)
        self.llt.fill_next_token_bitmask(m, bm, 0)
        return bm

    def allowed(self, bm: torch.Tensor) -> torch.Tensor:
        return unpack(bm, self.vocab)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        eos = hf.convert_tokens_to_ids(hf.eos_token)
        self.eos = eos
        from kvserve.server.serving import _BYTE_DECODER  # byte-level piece -> its bytes

        pieces: dict[bytes, list[int]] = {}
        special = set(hf.all_special_ids)
        for piece, i in hf.get_vocab().items():
            if i != eos and i < vocab and i not in special:
                raw = bytes(_BYTE_DECODER[ch] for ch in piece)
                pieces.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, pieces)
        self.vocab = vocab

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, m):
        return m.get_tokens()

    def allowed(self, tokens) -> torch.Tensor:
        out = torch.zeros(self.vocab, dtype=torch.bool)
        out[torch.tensor(list(tokens), dtype=torch.long)] = True
        return out

    def accept(self, m, token: int) -> bool:
        m.advance(token)
        return True

    def done(self, m) -> bool:
        return m.is_finished()


def unpack(bm: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed int32 bitmask ([1, ceil(vocab/32)]) as a bool vector of `vocab`."""
    words = bm.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def walk_valid(lib, compiled, ids: list[int]) -> tuple[list[float], bool]:
    m = lib.matcher(compiled)
    times, ok = [], True
    for t in ids:
        start = time.perf_counter()
        mask = lib.mask(m)
        times.append(time.perf_counter() - start)
        ok &= bool(lib.allowed(mask)[t])
        lib.accept(m, t)
    mask = lib.allowed(lib.mask(m))
    return times, ok and (lib.done(m) or bool(mask[lib_eos(lib)]))


def lib_eos(lib) -> int:
    return getattr(lib, "eos", EOS)


def random_walk(lib, compiled, rng: random.Random, budget: int, hf) -> tuple[bool, str]:
    """Pick allowed tokens uniformly at random (a random-weight model) until the grammar
    allows EOS (taken at once) or the budget runs out; every size in SCHEMA is bounded."""
    m = lib.matcher(compiled)
    out: list[int] = []
    for step in range(budget):
        allowed = lib.allowed(lib.mask(m)).nonzero().flatten().tolist()
        if not allowed:
            return False, hf.decode(out)
        if EOS in allowed:
            return True, hf.decode(out)
        t = rng.choice(allowed)
        lib.accept(m, t)
        out.append(t)
    return False, hf.decode(out)


EOS = 0


def main() -> int:
    global EOS
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--walks", type=int, default=20)
    p.add_argument("--budget", type=int, default=300)
    p.add_argument("--verbose", action="store_true", help="print the invalid outputs")
    args = p.parse_args()
    from kvserve.model_loader.make_model import default_model_dir, ensure_default_model

    print(cpu_line())
    models = {"stdlib-coder": str(default_model_dir()), "tiny-random": str(ensure_default_model())}
    for mname, mdir in models.items():
        hf = hf_tokenizer(mdir)
        vocab = json.loads(Path(mdir, "config.json").read_text())["vocab_size"]
        EOS = hf.convert_tokens_to_ids(hf.eos_token)
        ids = hf.encode(json.dumps(DOC), add_special_tokens=False)
        print(f"\n== {mname}: vocab {vocab}, the valid document is {len(ids)} tokens")
        print(f"{'library':<14} {'setup ms':>9} {'compile ms':>11} {'mask us/tok':>12} "
              f"{'valid doc':>10} {'walks ended':>12} {'ended valid':>12}")
        for cls in (XGrammar, XGrammarStrictStrings, LLGuidance, OutlinesCore):
            try:
                t0 = time.perf_counter()
                lib = cls(hf, vocab)
                setup = time.perf_counter() - t0
                t0 = time.perf_counter()
                compiled = lib.compile(SCHEMA)
                comp = time.perf_counter() - t0
                times, ok = walk_valid(lib, compiled, ids)
                rng = random.Random(0)
                good = ends = 0
                for _ in range(args.walks):
                    ended, text = random_walk(lib, compiled, rng, args.budget, hf)
                    ends += ended
                    try:
                        jsonschema.validate(json.loads(text), SCHEMA)
                        good += ended
                    except (ValueError, jsonschema.ValidationError) as exc:
                        if ended and args.verbose:
                            print(f"  {cls.name} invalid: {text!r}: {str(exc)[:80]}")
                print(f"{cls.name:<14} {setup * 1e3:>9.1f} {comp * 1e3:>11.1f} "
                      f"{statistics.median(times) * 1e6:>12.1f} {str(ok):>10} "
                      f"{ends:>6}/{args.walks:<5} {good:>6}/{ends:<5}")
            except Exception as exc:  # a library that fails on this tokenizer is a finding
                print(f"{cls.name:<14} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
