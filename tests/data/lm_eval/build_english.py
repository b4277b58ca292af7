"""Builds english_mc.jsonl and english_ppl.jsonl, the two English lm-eval tasks, from text found
on the machine (kvserve.eval.corpus's English documents: /usr/share/common-licenses, the
running Python's LICENSE.txt, installed packages' README descriptions). Nothing downloads.

A paragraph qualifies when, with its whitespace collapsed, it ends with a full stop, is at
least 95% letters and spaces, is not all capitals, starts with a letter and has no URL,
backtick, '|', '*' or '='. english_mc: from each document its first two qualifying paragraphs
of 20 words or more, the last word to be chosen (a cloze, as LAMBADA) among it and three other
words of 4 letters or more from the same paragraph (random.Random(14), the position of the
answer drawn too). english_ppl: the first paragraph of 50-120 words of each document, the
first 8 documents that have one.

    PYTHONPATH=$PWD .venv/bin/python tests/data/lm_eval/build_english.py
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from kvserve.eval.corpus import documents

HERE = Path(__file__).resolve().parent


def paragraphs(text: str):
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(para.split())
        letters = sum(c.isalpha() or c.isspace() for c in p) / max(1, len(p))
        if (letters > 0.95 and p.endswith(".") and not p.isupper() and p[0].isalpha()
                and not any(s in p for s in ("http", "`", "|", "*", "="))):
            yield p, p.split()


def source(name: str) -> str:
    return name.split("/")[-1].replace(" METADATA description", "")


def main() -> None:
    rng = random.Random(14)
    mc, ppl = [], []
    for doc in documents("english"):
        paras = list(paragraphs(doc.text))
        for p, words in [(p, w) for p, w in paras if len(w) >= 20][:2]:
            target = words[-1].rstrip(".")
            pool = sorted({x for x in words[:-1]
                           if x.isalpha() and len(x) >= 4 and x.lower() != target.lower()})
            if not target.isalpha() or len(pool) < 3:
                continue
            distractors = rng.sample(pool, 3)
            label = rng.randrange(4)
            choices = distractors[:label] + [target] + distractors[label:]
            mc.append({"source": source(doc.name), "context": " ".join(words[:-1]),
                       "choices": [" " + c for c in choices], "label": label})
        longer = [p for p, w in paras if 50 <= len(w) <= 120]
        if longer and len(ppl) < 8:
            ppl.append({"source": source(doc.name), "text": longer[0] + "\n"})
    for name, rows in (("english_mc.jsonl", mc), ("english_ppl.jsonl", ppl)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} items")


if __name__ == "__main__":
    main()
