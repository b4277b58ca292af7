"""Chat request logs with known prefix-cache pollution, seeded: for the tests, and for trying
`kvserve diagnose` without a production log (`python -m kvserve.diagnose.synth OUT.jsonl`).

Every request shares one system prompt (a support assistant's instructions and few-shot
examples) and asks its own question. A request is clean, or carries exactly one planted class:

- timestamp: "Current date and time: <ISO 8601>" after the first line, a new second each time;
- id: "Session id: <uuid4>" before the examples;
- reordered: the few-shot examples in a random order;
- whitespace: trailing spaces on the first line, one to three of them.

These are the ways real clients defeat a prefix cache (a timestamp or request id templated into
the system prompt, examples drawn from an unordered set, prompts assembled by string
concatenation); the questions differ, as real users' do, only at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from datetime import datetime, timedelta, timezone

PLANTED = ("timestamp", "id", "reordered", "whitespace")

_INTRO = "You are Orbit, the support assistant of Acme Cloud, a hosting company."
_POLICY = [
    "Answer only questions about Acme Cloud's products: virtual machines, object storage, "
    "managed databases and the billing console. For anything else, say politely that you can "
    "only help with Acme Cloud.",
    "Never ask for passwords or full card numbers. If a user shares one, tell them to rotate "
    "it at once and do not repeat it.",
    "When a question needs an account change, explain the steps in the console; you cannot "
    "change accounts yourself.",
]
_EXAMPLES = [
    "Q: How do I resize a virtual machine?\nA: Stop it, choose Resize in its menu, pick the "
    "new size and start it again.",
    "Q: Why was I billed twice this month?\nA: One charge is usually the previous month's "
    "usage; the billing console lists both with their periods.",
    "Q: Can I make a storage bucket public?\nA: Yes: open the bucket, choose Permissions and "
    "allow public reads; keep write access private.",
    "Q: How do I restore a database backup?\nA: Open the database, choose Backups, pick a "
    "point in time and restore it to a new instance.",
    "Q: Where do I find my API keys?\nA: Under Account, then API keys; create one per "
    "application so that you can revoke them one by one.",
]
_CLOSING = "Answer the user's question in one or two short sentences."
_VERBS = ["resize", "back up", "delete", "rename", "move", "monitor", "encrypt", "share"]
_NOUNS = ["virtual machine", "bucket", "database", "domain", "snapshot", "volume",
          "firewall", "load balancer"]
_WHERE = ["in Europe", "from the console", "with the CLI", "on a weekend", "without downtime",
          "for a team", "automatically", "in another region"]


def system_prompt(kind: str, rng: random.Random, when: datetime) -> str:
    """The shared system prompt, with the pollution of `kind` planted ("clean": none)."""
    intro = _INTRO
    if kind == "whitespace":
        intro += " " * rng.randint(1, 3)
    parts = [intro]
    if kind == "timestamp":
        parts[0] += f"\nCurrent date and time: {when.strftime('%Y-%m-%dT%H:%M:%SZ')}"
    parts += _POLICY
    if kind == "id":
        parts.append(f"Session id: {uuid.UUID(int=rng.getrandbits(128), version=4)}")
    examples = list(_EXAMPLES)
    if kind == "reordered":
        while examples == _EXAMPLES:
            rng.shuffle(examples)
    parts += examples
    parts.append(_CLOSING)
    return "\n\n".join(parts)


def questions(rng: random.Random) -> list[str]:
    """Every distinct question, shuffled (a log draws without repeats)."""
    qs = [f"How do I {v} my {n} {w}?" for v in _VERBS for n in _NOUNS for w in _WHERE]
    rng.shuffle(qs)
    return qs


def generate(n: int, seed: int = 0, clean_fraction: float = 0.4,
             classes: tuple[str, ...] = PLANTED) -> list[dict]:
    """`n` chat request bodies, each clean with probability `clean_fraction`, else polluted
    with one of `classes` (evenly), each with its planted class under "planted"."""
    for c in classes:
        if c not in PLANTED:
            raise ValueError(f"unknown class {c!r}: one of {', '.join(PLANTED)}")
    rng = random.Random(seed)
    qs = questions(rng)
    if n > len(qs):
        raise ValueError(f"at most {len(qs)} requests (distinct questions)")
    when = datetime(2026, 12, 2, 9, 0, 0, tzinfo=timezone.utc)
    out = []
    for i in range(n):
        when += timedelta(seconds=rng.randint(1, 90))
        kind = "clean" if not classes or rng.random() < clean_fraction else rng.choice(classes)
        out.append({"messages": [{"role": "system", "content": system_prompt(kind, rng, when)},
                                 {"role": "user", "content": qs[i]}],
                    "max_tokens": 1, "temperature": 0.0, "planted": kind})
    return out


def write(bodies: list[dict], path: str, keep_planted: bool = False) -> None:
    """OpenAI-format JSONL (the "planted" label dropped unless asked for: it is no field of
    a request)."""
    with open(path, "w", encoding="utf-8") as f:
        for b in bodies:
            if not keep_planted:
                b = {k: v for k, v in b.items() if k != "planted"}
            f.write(json.dumps(b) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.diagnose.synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clean-fraction", type=float, default=0.4)
    p.add_argument("--classes", nargs="*", default=list(PLANTED), choices=PLANTED)
    args = p.parse_args(argv)
    write(generate(args.n, args.seed, args.clean_fraction, tuple(args.classes)), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
