"""The workloads `kvserve bench` sends, with vLLM's dataset names where they exist.

- random: --random-input-len prompt tokens (+/- --random-range-ratio) after an optional common
  --random-prefix-len prefix, --random-output-len new tokens each.
- prefix_repetition: --prefix-repetition-num-prefixes shared prefixes of
  --prefix-repetition-prefix-len tokens, each request one of them (in turn) + a unique
  --prefix-repetition-suffix-len suffix, --prefix-repetition-output-len new tokens.
- multi_turn (kvserve's): --num-prompts conversations behind one shared system prompt of
  --multi-turn-system-len words, each --multi-turn-turns user turns of --multi-turn-user-len
  words; every turn sends the whole conversation so far (the answers the server gave included).

What is sent (--prompt-format): `token-ids` (random and prefix_repetition: prompts as lists of
token ids, so lengths are exact on the server that owns the vocabulary; kvserve and vLLM take
them) or `text` (words of about one token each in byte-level BPE vocabularies: portable to any
OpenAI-compatible server, lengths approximate; the server's usage gives the real counts).
multi_turn always sends text (chat messages).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DATASETS = ("random", "prefix_repetition", "multi_turn")
PROMPT_FORMATS = ("token-ids", "text")

# Short common words: about one token each in byte-level BPE vocabularies.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there one all we their can has been if more "
         "when will would who so no time out up into could new than some these two may first "
         "then do any like my now over such our man me even most made after also did many off "
         "before must well back through years much where your way down should because each just "
         "those people how too little state good very make world still own see men work long "
         "here get both between life being under never day same another know while last might "
         "us great old year come since against go came right used take three").split()


@dataclass
class BenchRequest:
    """One request: the prompt (token ids or text), its length in tokens (words for text) and
    the tokens to generate."""
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class Conversation:
    """A user of the multi_turn workload: the system prompt and the user turns, in order."""
    system: str
    user_turns: list[str]
    output_len: int


@dataclass
class TokenSource:
    """Random prompt material: token ids in [low, high) or words."""
    rng: random.Random
    fmt: str = "token-ids"
    low: int = 10
    high: int = 2000

    def piece(self, n: int) -> list[int] | list[str]:
        if self.fmt == "text":
            return [self.rng.choice(WORDS) for _ in range(n)]
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]

    def prompt(self, parts: list) -> str | list[int]:
        return " ".join(parts) if self.fmt == "text" else list(parts)


def random_requests(n: int, input_len: int, output_len: int, src: TokenSource,
                    range_ratio: float = 0.0, prefix_len: int = 0) -> list[BenchRequest]:
    """vLLM's `random`: lengths drawn uniformly in [len * (1 - ratio), len * (1 + ratio)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must lie in [0, 1)")
    prefix = src.piece(prefix_len)
    out = []
    for _ in range(n):
        lo, hi = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
        ilen = src.rng.randint(max(lo, 1), max(hi, 1))
        olo, ohi = int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))
        olen = src.rng.randint(max(olo, 1), max(ohi, 1))
        out.append(BenchRequest(src.prompt(prefix + src.piece(ilen)), prefix_len + ilen, olen))
    return out


def prefix_repetition_requests(n: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, src: TokenSource) -> list[BenchRequest]:
    """vLLM's `prefix_repetition`: request i = prefix[i % num_prefixes] + a unique suffix."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    prefixes = [src.piece(prefix_len) for _ in range(num_prefixes)]
    return [BenchRequest(src.prompt(prefixes[i % num_prefixes] + src.piece(suffix_len)),
                         prefix_len + suffix_len, output_len) for i in range(n)]


def multi_turn_conversations(n: int, turns: int, system_len: int, user_len: int,
                             output_len: int, seed: int) -> list[Conversation]:
    """n users behind one system prompt (the same text for everyone, as a product's is)."""
    system = " ".join(TokenSource(random.Random(seed - 1), "text").piece(system_len))
    convs = []
    for uid in range(n):
        src = TokenSource(random.Random(seed * 1000 + uid), "text")
        convs.append(Conversation(system, [" ".join(src.piece(user_len)) for _ in range(turns)],
                                  output_len))
    return convs


def add_dataset_args(p) -> None:
    """The dataset flags of `kvserve bench serve` (vLLM's names)."""
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="token-ids",
                   help="random / prefix_repetition prompts as token ids (exact lengths; kvserve,"
                   " vLLM) or as text (any server; lengths approximate) (default token-ids)")
    p.add_argument("--token-id-range", default="10,2000", metavar="LOW,HIGH",
                   help="random token ids are drawn in [LOW, HIGH) (keep HIGH under the "
                   "vocabulary size; default 10,2000)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=1)
    p.add_argument("--prefix-repetition-output-len", type=int, default=32)
    p.add_argument("--multi-turn-turns", type=int, default=3)
    p.add_argument("--multi-turn-system-len", type=int, default=256,
                   help="words of the shared system prompt (default 256)")
    p.add_argument("--multi-turn-user-len", type=int, default=32,
                   help="words per user turn (default 32)")
    p.add_argument("--multi-turn-output-len", type=int, default=32)


def build(args) -> list[BenchRequest] | list[Conversation]:
    """The workload that `add_dataset_args`' flags describe."""
    if args.dataset_name == "multi_turn":
        return multi_turn_conversations(args.num_prompts, args.multi_turn_turns,
                                        args.multi_turn_system_len, args.multi_turn_user_len,
                                        args.multi_turn_output_len, args.seed)
    low, high = (int(x) for x in args.token_id_range.split(","))
    src = TokenSource(random.Random(args.seed), args.prompt_format, low, high)
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, src)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, src,
                           args.random_range_ratio, args.random_prefix_len)
