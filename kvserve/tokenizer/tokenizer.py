"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus what a serving engine needs around it.

* `Tokenizer` loads a Hugging Face tokenizer directory (a real checkpoint's, or one written by
  `kvserve.tokenizer.train.train_tokenizer`), encodes, decodes, collects the end of sequence ids
  from the three places checkpoints keep them, and renders chat templates the way Hugging Face
  does (sandboxed Jinja, `trim_blocks`/`lstrip_blocks`, non-ASCII `tojson`).
* `IncrementalDetokenizer` turns a stream of token ids into a stream of text deltas, holding back
  bytes of a character that is not complete yet, with a bounded decode window per token.
* `find_stop` / `holdback` are the stop-string helpers for streaming.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

from kvserve.models.config import read_json_object

__all__ = [
    "IncrementalDetokenizer",
    "Tokenizer",
    "find_stop",
    "holdback",
]

_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------------------------
# Chat templates: a sandboxed Jinja environment set up like Hugging Face's.
# --------------------------------------------------------------------------------------------

def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_JINJA_ENV = None


def _jinja_env():
    global _JINJA_ENV
    if _JINJA_ENV is None:
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationBlock(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks);
            for rendering it is transparent."""

            tags = {"generation"}

            def parse(self, parser: Any) -> list[nodes.Node]:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[GenerationBlock, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _JINJA_ENV = env
    return _JINJA_ENV


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON file of the checkpoint: {} when absent, parsed as the model loader
    parses config.json when present."""
    return read_json_object(path) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# tokenizer.json components that never delete input characters (what the length bound of
# `Tokenizer.min_num_tokens` needs); the normalizers are the identity on ASCII text only.
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                                  "UnicodeScripts", "Sequence"})
_ASCII_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Sequence"})


def _keeps_every_char(spec: Any, safe: frozenset[str]) -> bool:
    """Whether a tokenizer.json normalizer/pre-tokenizer (None = absent) is built only of
    `safe` parts (a Split that removes its matches is not)."""
    if spec is None:
        return True
    if not isinstance(spec, dict) or spec.get("type") not in safe:
        return False
    if spec["type"] == "Split" and spec.get("behavior") == "Removed":
        return False
    parts = spec.get("pretokenizers", spec.get("normalizers"))
    return spec["type"] != "Sequence" or all(_keeps_every_char(p, safe) for p in parts or ())


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the settings from the checkpoint's JSON files."""

    _normalizes_non_ascii = False  # set by max_chars_per_token

    def __init__(self, backend: tokenizers.Tokenizer,
                 tokenizer_config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None,
                 model_config: dict[str, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.config = dict(tokenizer_config or {})
        cfg = self.config

        self._special_strings: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(cfg.get(key))
            if content is not None:
                self._special_strings[key] = content

        def token_id(key: str) -> int | None:
            content = self._special_strings.get(key)
            return None if content is None else backend.token_to_id(content)

        self.bos_token_id: int | None = token_id("bos_token")
        self.pad_token_id: int | None = token_id("pad_token")
        if self.bos_token_id is None:
            for source in (generation_config or {}, model_config or {}):
                ids = _int_ids(source.get("bos_token_id"))
                if ids:
                    self.bos_token_id = ids[0]
                    break

        eos: set[int] = set()
        config_eos = token_id("eos_token")
        if config_eos is not None:
            eos.add(config_eos)
        for source in (generation_config or {}, model_config or {}):
            eos.update(_int_ids(source.get("eos_token_id")))
        self._eos_token_ids = frozenset(eos)

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self.bos_token_id, config_eos, self.pad_token_id,
                                   token_id("unk_token")) if i is not None)
        self._all_special_ids = sorted(special)

        # What `add_special_tokens` adds is the tokenizer.json post-processor's business (as in
        # Hugging Face, whose v5 ignores add_bos_token when tokenizer.json exists), plus a BOS when
        # tokenizer_config.json asks for one and the post-processor did not put it there.
        self._add_bos = cfg.get("add_bos_token") is True

        template = cfg.get("chat_template") if chat_template is None else chat_template
        self._chat_templates: dict[str, str] = {}
        if isinstance(template, str):
            self._chat_templates["default"] = template
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            for item in template:
                if isinstance(item, dict) and isinstance(item.get("name"), str) \
                        and isinstance(item.get("template"), str):
                    self._chat_templates[item["name"]] = item["template"]
        self._compiled: dict[str, Any] = {}

        max_len = cfg.get("model_max_length")
        self.model_max_length: int | None = (
            max_len if isinstance(max_len, int) and 0 < max_len < 10**12 else None)

    @classmethod
    def from_dir(cls, path: Path | str) -> "Tokenizer":
        """Load tokenizer.json and tokenizer_config.json (plus generation_config.json, config.json
        and chat_template.jinja when present) from a checkpoint directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for bad files
            raise ValueError(f"cannot load {tokenizer_file}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        chat_template = None
        if "chat_template" not in config and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, config, _read_json(path / "generation_config.json"),
                   _read_json(path / "config.json"), chat_template)

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer_config.json eos token, else the smallest of `eos_token_ids`."""
        content = self._special_strings.get("eos_token")
        token_id = None if content is None else self.backend.token_to_id(content)
        if token_id is None and self._eos_token_ids:
            token_id = min(self._eos_token_ids)
        return token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._all_special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- length bound without encoding ---------------------------------------------------------

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, when that is knowable
        from the vocabulary: the longest vocabulary entry (a byte-level piece has one character
        per byte, and a text character is at least one byte; a SentencePiece piece has one per
        character). None when a normalizer or pre-tokenizer could delete text (then no bound
        from the text's length holds)."""
        spec = json.loads(self.backend.to_str())
        if not _keeps_every_char(spec.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS):
            return None
        normalizer = spec.get("normalizer")
        if normalizer is not None and not _keeps_every_char(normalizer, _ASCII_NORMALIZERS):
            return None
        self._normalizes_non_ascii = normalizer is not None
        pieces = self.backend.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in pieces), default=0) or None

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, in O(1) for ASCII text: a token covers at
        most `max_chars_per_token` characters. 0 when no bound is known (a normalizer that may
        shorten non-ASCII text, such as NFC composing accents)."""
        per_token = self.max_chars_per_token
        if per_token is None or (self._normalizes_non_ascii and not text.isascii()):
            return 0
        return -(-len(text) // per_token)

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        bos = self.bos_token_id
        if add_special_tokens and self._add_bos and bos is not None:
            # special_tokens_mask marks what the post-processor added (not specials in the text)
            if not (ids and ids[0] == bos and encoding.special_tokens_mask[0]):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # Ids the vocabulary does not have (the model's embedding may be larger) decode to nothing.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        templates = self._chat_templates
        return templates.get("default") or next(iter(templates.values()), None)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render the checkpoint's chat template to a prompt string (encode it with
        `add_special_tokens=False`: the template already has the special tokens it wants)."""
        if not self._chat_templates:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); pass a plain prompt instead")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of "
                             "{'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{i}] needs a string 'content', "
                                 f"got {type(message.get('content')).__name__}")
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise ValueError("tools must be a list of JSON-schema dicts")
            tools = list(tools)

        if tools and "tool_use" in self._chat_templates:
            name = "tool_use"
        elif "default" in self._chat_templates:
            name = "default"
        else:
            name = next(iter(self._chat_templates))

        import jinja2.exceptions

        try:
            compiled = self._compiled.get(name)
            if compiled is None:
                compiled = _jinja_env().from_string(self._chat_templates[name])
                self._compiled[name] = compiled
            variables: dict[str, Any] = dict(self._special_strings)
            variables.update(kwargs)
            variables.update(messages=list(messages), tools=tools,
                             add_generation_prompt=add_generation_prompt)
            return compiled.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------

class IncrementalDetokenizer:
    """Turn generated token ids into text deltas, one token at a time.

    Each step decodes only a short window: a few tokens of already-emitted context (decoders such
    as SentencePiece's drop the leading space of the first token they see, so context keeps word
    boundaries right) plus the tokens not emitted yet. Text that ends in U+FFFD is held back: with
    byte-level BPE that is a character whose bytes have not all arrived. Once the window decodes
    cleanly again, the held text is emitted and the window slides forward.

    If `PENDING_LIMIT` tokens in a row leave the text ending in U+FFFD (garbage output, not an
    unfinished character) the replacement characters are emitted anyway to keep the work per token
    bounded. `flush()` emits whatever is held back when the sequence ends.
    """

    CONTEXT_TOKENS = 4
    PENDING_LIMIT = 64

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decode_fn = tokenizer.decode
        self.skip_special_tokens = skip_special_tokens
        context = prompt_ids[-self.CONTEXT_TOKENS:] if len(prompt_ids) else ()
        self._ids: list[int] = [int(i) for i in context]
        self._read = len(self._ids)  # ids before this index have had their text emitted
        self._emitted = len(self._decode(self._ids))  # chars of decode(self._ids) emitted
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self.num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache] if self._text_cache else []
        return self._text_cache

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (possibly "")."""
        self.num_tokens += 1
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        end = len(text)
        clean = not text.endswith(_REPLACEMENT_CHAR)
        if not clean and len(self._ids) - self._read < self.PENDING_LIMIT:
            end = len(text.rstrip(_REPLACEMENT_CHAR))
        delta = text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if end == len(text):  # everything decoded is out: slide the window
            self._read = len(self._ids)
            if len(self._ids) > 2 * self.CONTEXT_TOKENS:
                self._ids = self._ids[-self.CONTEXT_TOKENS:]
                self._read = len(self._ids)
                self._emitted = len(self._decode(self._ids))
        return self._emit(delta)

    def flush(self) -> str:
        """Emit text held back at the end of the sequence (replacement characters included)."""
        text = self._decode(self._ids)
        delta = text[self._emitted:] if len(text) > self._emitted else ""
        self._emitted = max(self._emitted, len(text))
        self._read = len(self._ids)
        return self._emit(delta)


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------

def find_stop(text: str, new_delta_len: int, stops: Sequence[str]) -> int | None:
    """Index in `text` where the earliest stop string starts, or None.

    Only matches that include at least one of the last `new_delta_len` characters are looked for
    (earlier text was searched when it arrived), so the work is proportional to the delta.
    """
    stops = [s for s in stops if s]
    if not stops or new_delta_len <= 0:
        return None
    best: int | None = None
    for stop in stops:
        i = text.find(stop, max(0, len(text) - new_delta_len - len(stop) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of some stop string, and so must
    not be streamed yet (the next tokens may complete the stop string)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes byte b as one printable character: b itself for the printable
    Latin-1 bytes, 256 + k for the k-th of the others (the GPT-2 scheme). Inverse map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in printable}
    k = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + k
            k += 1
    return {chr(c): b for b, c in chars.items()}


BYTE_DECODER = byte_level_alphabet()  # byte-level BPE character -> byte
