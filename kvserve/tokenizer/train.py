"""The tokenizer the tests and `make_model` checkpoints ship: a small byte-level BPE trained
offline, from a corpus generated in code, written in Hugging Face format.

It lives apart from `kvserve.tokenizer.tokenizer` because serving never trains: the engine only loads,
encodes and decodes, and should not carry a word list and a PRNG to do so. The corpus is built
from a fixed seed with a fixed PRNG (not Python's `random`), so the same arguments give
byte-identical files on every machine and every Python version.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

__all__ = ["BOS_TOKEN_ID", "CHATML_TEMPLATE", "EOS_TOKEN_ID", "SPECIAL_TOKENS", "train_tokenizer",
           "write_tokenizer_config"]

# Special tokens of the tokenizers we train, at fixed ids (the trainer places them first).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID = 0  # <|endoftext|>, also the padding token
EOS_TOKEN_ID = 2  # <|im_end|>, the end of every chat turn

# ChatML, with tools as Qwen2.5 writes them: the function signatures go in one system turn
# (merged with the first system message) inside <tools></tools>, an assistant's calls are
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (kvserve.structured.tool_calls
# constrains and kvserve.server.tool_parser reads that format), and consecutive tool results go
# in one user turn, each inside <tool_response></tool_response>. Arguments may be given as an
# object or as JSON text (OpenAI's form), which is written as it is.
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "{{- messages[0]['content'] + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' + tool | tojson }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['content'] is not string %}\n"
    "{{- raise_exception('message content must be a string') }}\n"
    "{%- endif %}\n"
    "{%- if tools and loop.first and message['role'] == 'system' %}\n"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}\n"
    "{{- '<|im_start|>assistant' }}\n"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}\n"
    "{%- for call in message['tool_calls'] %}\n"
    "{%- set f = call['function'] if call.get('function') is not none else call %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}\n"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}"
    "{%- else %}{{- f['arguments'] | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message['role'] == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


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

    write_tokenizer_config(out_dir, model_max_length)


def write_tokenizer_config(out_dir: Path | str, model_max_length: int) -> None:
    """tokenizer_config.json for a tokenizer with `SPECIAL_TOKENS` at ids 0..2 and the ChatML
    template: shared by the test tokenizers and the trained `stdlib-coder` model."""
    out_dir = Path(out_dir)
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
