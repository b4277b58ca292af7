"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus what a serving engine needs around it.

* `train_tokenizer` builds a small byte-level BPE tokenizer offline, from a corpus generated in code
  (so it is identical on every machine and every Python version), and writes it in Hugging Face
  format (`tokenizer.json` + `tokenizer_config.json` with a ChatML chat template).
* `Tokenizer` loads such a directory (or a real checkpoint's), encodes, decodes, collects the end
  of sequence ids from the three places checkpoints keep them, and renders chat templates the way
  Hugging Face does (sandboxed Jinja, `trim_blocks`/`lstrip_blocks`, non-ASCII `tojson`).
* `IncrementalDetokenizer` turns a stream of token ids into a stream of text deltas, holding back
  bytes of a character that is not complete yet, with a bounded decode window per token.
* `find_stop` / `holdback` are the stop-string helpers for streaming.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "SPECIAL_TOKENS",
    "CHATML_TEMPLATE",
    "IncrementalDetokenizer",
    "Tokenizer",
    "find_stop",
    "holdback",
    "train_tokenizer",
]

# Special tokens of the tokenizers we train, at fixed ids (the trainer places them first).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID = 0  # <|endoftext|>, also the padding token
EOS_TOKEN_ID = 2  # <|im_end|>, the end of every chat turn

# ChatML. Tools, when given, go in one system turn (merged with the first system message) as one
# JSON object per line. The roles are whatever the caller uses.
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "{{- messages[0]['content'] + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- 'You may call these tools:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson + '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['content'] is not string %}\n"
    "{{- raise_exception('message content must be a string') }}\n"
    "{%- endif %}\n"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------------------------
# Training corpus: generated in code from a fixed seed, no files, no network.
# --------------------------------------------------------------------------------------------

_NOUNS = """
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education foot boy age policy
music market sense nation plan college interest death experience effect class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple
site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population site river garden island bridge mountain forest village kitchen letter stone
engine memory kernel cache token server request queue batch tensor model layer weight signal
network library function variable module process thread buffer file folder screen keyboard
dog cat fox bird fish horse apple bread coffee tea question answer assistant user message
""".split()

_VERBS = """
be have do say get make go know take see come think look want give use find tell ask work seem
feel try leave call need become put mean keep let begin help talk turn start show hear play run
move like live believe hold bring happen write provide sit stand lose pay meet include continue
set learn change lead understand watch follow stop create speak read allow add spend grow open
walk win offer remember love consider appear buy wait serve die send expect build stay fall cut
reach kill remain suggest raise pass sell require report decide pull return explain hope develop
carry break receive agree support hit produce eat cover catch draw choose cause point listen
realize place close involve thank compute store load save print sort count measure compare
jump swim fly sing dance cook clean fix answer translate summarize
""".split()

_PAST = """
was had did said got made went knew took saw came thought looked wanted gave used found told
asked worked seemed felt tried left called needed became put meant kept let began helped talked
turned started showed heard played ran moved liked lived believed held brought happened wrote
provided sat stood lost paid met included continued set learned changed led understood watched
followed stopped created spoke read allowed added spent grew opened walked won offered remembered
loved considered appeared bought waited served died sent expected built stayed fell cut reached
remained suggested raised passed sold required reported decided pulled returned explained hoped
developed carried broke received agreed supported hit produced ate covered caught drew chose
caused pointed listened realized placed closed involved thanked computed stored loaded saved
jumped swam flew sang danced cooked cleaned fixed answered translated summarized
""".split()

_ADJECTIVES = """
good new first last long great little own other old right big high different small large next
early young important few public bad same able quick lazy brown bright dark cold warm hot quiet
loud simple easy hard clear full special free strong whole real best better sure low late
general specific certain open red blue green white black happy sad ready short wide deep final
main common local national human political social economic recent possible major similar strange
careful gentle honest modern ancient empty heavy light rich poor safe sharp smooth soft sweet
""".split()

_ADVERBS = """
quickly slowly carefully quietly loudly easily really very often never always sometimes usually
again also just still already soon today yesterday tomorrow now then here there together almost
finally suddenly certainly probably perhaps clearly simply nearly rather quite well badly early
""".split()

_PREPOSITIONS = """
in on at by for with about against between into through during before after above below to from
up down over under near behind beside across along around without within toward upon among
""".split()

_DETERMINERS = ("the a this that every each some any no one another my your his her our "
                "their").split()
_PRONOUNS = "I you he she it we they someone everyone nobody".split()
_CONJUNCTIONS = "and but or so because while although when if unless until since".split()
_CONTRACTIONS = (
    "don't can't won't isn't aren't wasn't weren't didn't doesn't haven't hasn't wouldn't "
    "couldn't shouldn't it's that's there's I'm you're we're they're I've you've we've I'll "
    "you'll she'll let's"
).split()

# Syllables for made-up proper names; they give the trainer many distinct words to merge, so that
# larger vocabularies are reachable from a corpus of bounded size.
_ONSETS = ("b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sh sk sl sp st t th "
           "tr v w z").split()
_VOWELS = "a e i o u ai ea ee ia io oa ou y".split()
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "st", "x", "m", "ck", "ng"]

_FOREIGN = [
    "Café au lait, s'il vous plaît. Voilà, déjà vu, naïve, façade, élève, très bien.",
    "Über die Brücke gehen wir schön langsam. Größe, Mädchen, Fräulein, Straße.",
    "El niño comió una manzana. ¿Dónde está la estación? ¡Qué día tan bonito!",
    "Ça va? Oui, ça va très bien, merci. Où est la bibliothèque?",
    "Москва — столица России. Привет, как дела? Спасибо, хорошо.",
    "Αθήνα είναι η πρωτεύουσα της Ελλάδας. Καλημέρα, τι κάνεις;",
    "東京は日本の首都です。今日はいい天気ですね。ありがとうございます。",
    "北京是中国的首都。你好，世界！我们一起学习中文。今天天气很好。",
    "서울은 한국의 수도입니다. 안녕하세요, 감사합니다.",
    "नमस्ते दुनिया। यह एक परीक्षण वाक्य है।",
    "مرحبا بالعالم. هذه جملة تجريبية.",
    "Emoji time: 😀 😂 🎉 👍 ❤️ 🚀 🌍 🔥 ✨ 🙂 — and a family: 👨‍👩‍👧‍👦.",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, √2 ≈ 1.414, α β γ δ ε → λ μ σ ω.",
    "Quotes “like these” and ‘these’, dashes – and —, ellipsis… and bullets • here.",
]

_CODE = [
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "for {a} in range({n}):\n    print({a}, {b})\n",
    "if {a} is None:\n    raise ValueError(\"{a} must not be None\")\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "{a} = [{n}, {m}, {n}]  # a list of numbers\n",
    "import os\nimport sys\n\nprint(sys.argv[{n}], os.getcwd())\n",
    "while {a} < {n}:\n    {a} += 1\n",
    "{{\"{a}\": {n}, \"{b}\": [true, false, null], \"name\": \"{F}\"}}\n",
    "<div class=\"{a}\"><p>{F} {n}</p></div>\n",
    "$ python -m {a} --{b}={n} > out.txt\n",
]


class _SplitMix64:
    """A tiny PRNG with a fixed algorithm, so the corpus does not depend on Python's `random`."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = seed & self._MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.next() % len(seq)]

    def chance(self, numerator: int, denominator: int) -> bool:
        return self.below(denominator) < numerator


def _make_names(rng: _SplitMix64, count: int) -> list[str]:
    names: dict[str, None] = {}
    while len(names) < count:
        syllables = 2 + rng.below(2)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        word += rng.choice(_CODAS)
        names[word] = None
    return list(names)


def _noun_phrase(rng: _SplitMix64, names: list[str]) -> str:
    if rng.chance(1, 6):
        return rng.choice(names).capitalize()
    det = rng.choice(_DETERMINERS)
    noun = rng.choice(_NOUNS)
    if det in ("some", "no", "our", "their", "my", "your") and rng.chance(1, 2):
        noun += "s"
    if rng.chance(2, 5):
        return f"{det} {rng.choice(_ADJECTIVES)} {noun}"
    return f"{det} {noun}"


def _sentence(rng: _SplitMix64, names: list[str]) -> str:
    kind = rng.below(10)
    if kind == 9:
        greeting = rng.choice(("Hello", "Hi", "Hey", "Good morning", "Thanks", "Sure", "Yes", "No"))
        s = (f"{greeting}, {rng.choice(names).capitalize()}! How {rng.choice(('are', 'were'))} "
             f"{_noun_phrase(rng, names)} today? {rng.choice(_CONTRACTIONS).capitalize()} "
             f"{rng.choice(_ADJECTIVES)}.")
    elif kind == 0:
        s = (f"{_noun_phrase(rng, names)} {rng.choice(_PAST)} {rng.choice(_PREPOSITIONS)} "
             f"{_noun_phrase(rng, names)}.")
    elif kind == 1:
        s = (f"{rng.choice(_PRONOUNS)} {rng.choice(_PAST)} {_noun_phrase(rng, names)} "
             f"{rng.choice(_ADVERBS)}.")
    elif kind == 2:
        s = f"why did {_noun_phrase(rng, names)} {rng.choice(_VERBS)} {_noun_phrase(rng, names)}?"
    elif kind == 3:
        s = (f"{rng.choice(_PRONOUNS)} {rng.choice(_CONTRACTIONS)} {rng.choice(_VERBS)} "
             f"{_noun_phrase(rng, names)}, {rng.choice(_CONJUNCTIONS)} {rng.choice(_PRONOUNS)} "
             f"{rng.choice(_PAST)} {rng.choice(_ADVERBS)}.")
    elif kind == 4:
        year = 1900 + rng.below(130)
        s = (f"in {year}, {rng.choice(names).capitalize()} {rng.choice(_PAST)} {rng.below(1000)} "
             f"{rng.choice(_NOUNS)}s for ${rng.below(100)}.{rng.below(100):02d}.")
    elif kind == 5:
        inner = _sentence(rng, names)
        s = f"{rng.choice(names).capitalize()} said, \"{inner}\""
    elif kind == 6:
        s = (f"{_noun_phrase(rng, names)} is {rng.choice(_ADJECTIVES)} {rng.choice(_CONJUNCTIONS)} "
             f"{_noun_phrase(rng, names)} is {rng.choice(_ADJECTIVES)}!")
    elif kind == 7:
        s = (f"{rng.choice(_ADVERBS)}, {rng.choice(_PRONOUNS)} will {rng.choice(_VERBS)} "
             f"{_noun_phrase(rng, names)} {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng, names)}.")
    else:
        s = (f"{rng.choice(_PRONOUNS)} {rng.choice(_PAST)} {_noun_phrase(rng, names)} "
             f"({rng.below(100)}%) {rng.choice(_PREPOSITIONS)} "
             f"{rng.below(24):02d}:{rng.below(60):02d}.")
    return s[0].upper() + s[1:]


def _zen_of_python() -> str:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import this  # noqa: F401  (prints the Zen on first import)
        return "".join(this.d.get(c, c) for c in this.s) + "\n"
    except Exception:  # a trimmed-down Python without `this`: the corpus just lacks it
        return ""


def _corpus(vocab_size: int) -> Iterator[str]:
    """Deterministic training text; its size grows with the requested vocabulary."""
    rng = _SplitMix64(0x6B7673657276)  # "kvserv"
    # Roughly one new made-up word per vocabulary entry beyond what the English part yields.
    names = _make_names(rng, max(200, vocab_size // 2))
    yield _zen_of_python()
    for text in _FOREIGN:
        yield (text + "\n") * 8
    num_paragraphs = 600 + vocab_size // 4
    for p in range(num_paragraphs):
        sentences = [_sentence(rng, names) for _ in range(3 + rng.below(5))]
        paragraph = " ".join(sentences)
        if rng.chance(1, 8):
            paragraph = "\n".join(f"- {s}" for s in sentences)
        elif rng.chance(1, 8):
            a, b = rng.choice(_NOUNS), rng.choice(_NOUNS)
            paragraph = rng.choice(_CODE).format(
                f=rng.choice(_VERBS) + "_" + a, F=rng.choice(names).capitalize(),
                a=a, b=b if b != a else b + "2", n=rng.below(100), m=rng.below(10000))
        if p % 50 == 0:
            paragraph += " " + rng.choice(_FOREIGN)
        yield paragraph + "\n\n"
    # every name once more, so each can become a single token
    for i in range(0, len(names), 16):
        yield " ".join(names[i:i + 16]) + "\n"


def train_tokenizer(out_dir: Path | str, vocab_size: int, *, model_max_length: int = 2048) -> None:
    """Train a byte-level BPE tokenizer offline and write it to `out_dir` in Hugging Face format.

    The same arguments give byte-identical files. The learned vocabulary may come out smaller than
    `vocab_size` when the corpus runs out of merges (the model's embedding may be larger).
    """
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be an integer >= {256 + len(SPECIAL_TOKENS)} "
                         f"(the byte alphabet plus the special tokens), got {vocab_size!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(vocab_size), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(token) != token_id:  # the trainer's contract; check it anyway
            raise RuntimeError(f"special token {token} got id {backend.token_to_id(token)}")
    backend.save(str(out_dir / "tokenizer.json"))

    added_tokens_decoder = {
        str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


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

def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"{path} not found")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


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
