"""A GGUF's tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) as the
tokenizer.json / tokenizer_config.json / generation_config.json a Hugging Face checkpoint
carries, so `kvserve.tokenizer.tokenizer.Tokenizer.from_dir` loads it like any other.

Byte-level BPE ("gpt2", the tokenizer of Llama 3, Qwen, SmolLM and most recent models) is
built; the text is split before BPE by the regexes llama.cpp uses for the file's
`tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp is the reference: the GGUF was made for it).
A SentencePiece vocabulary ("llama") is refused with a clear error: pass `--tokenizer DIR`.
"""

from __future__ import annotations

from typing import Any

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (the regexes applied one after another, BPE ignores merges for words
# already in the vocabulary)
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{name: ((_GPT2,), False) for name in ("gpt-2", "gpt2", "phi-2", "olmo", "jais")},
    **{name: ((r"\p{N}", _GPT2), False)
       for name in ("smollm", "codeshell", "exaone", "minerva", "mellum2")},
    **{name: ((_LLAMA3,), True)
       for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                    "midm-2.0", "lfm2", "smaug-bpe")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def has_tokenizer(metadata: dict[str, Any]) -> bool:
    return "tokenizer.ggml.model" in metadata and "tokenizer.ggml.tokens" in metadata


def tokenizer_files(metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ..., "generation_config.json": ...}."""
    if not has_tokenizer(metadata):
        raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model and "
                         "tokenizer.ggml.tokens): pass a Hugging Face tokenizer directory with "
                         "--tokenizer DIR (tokenizer= in LLM())")
    model = metadata["tokenizer.ggml.model"]
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, "
                         "'gpt2'): pass a Hugging Face tokenizer directory with --tokenizer DIR")
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    if pre not in _PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(_PRE))}): pass --tokenizer DIR")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
    regexes, ignore_merges = _PRE[pre]

    def special_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos, eos = special_id("bos"), special_id("eos")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t == _CONTROL}
             for i, (tok, t) in enumerate(zip(tokens, types)) if t in (_CONTROL, _USER_DEFINED)]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
               "invert": False} for r in regexes),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False,
                           "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    config: dict[str, Any] = {"add_bos_token": add_bos, "add_eos_token": False,
                              "clean_up_tokenization_spaces": False,
                              "model_max_length": None}
    for name, token_id in (("bos_token", bos), ("eos_token", eos),
                           ("pad_token", special_id("padding")),
                           ("unk_token", special_id("unknown"))):
        if token_id is not None:
            config[name] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    # llama.cpp stops at every end-of-generation token the file names.
    stop = [i for i in (eos, special_id("eot"), special_id("eom")) if i is not None]
    generation = {"bos_token_id": bos, "eos_token_id": sorted(set(stop)) or None}
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config,
            "generation_config.json": generation}
