"""Request traces: JSONL in, token ids out.

One JSON object per line, in either of two shapes (a file may mix them):

- token ids: `{"token_ids": [...], "output_length": 128}` (`prompt_token_ids` is accepted too;
  optional `output_token_ids`, the tokens the request generates, which a later turn of the same
  conversation may repeat in its prompt);
- block hashes, the shape public production traces use (Mooncake's):
  `{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}`,
  where hash id i names the i-th block of `block_size` prompt tokens (512 in Mooncake's traces)
  and equal ids mean equal blocks (and, since the ids are assigned by prefix, equal prefixes).

Optional on either: `timestamp` (milliseconds by default, see `time_unit`), `cache_salt`,
`priority`, and cache control as the server takes it (kv/retention.py): `kv_retention`
(TensorRT-LLM's {"priority", "ttl", "num_tokens"}), `cache_control` (Anthropic's breakpoint, for
the whole prompt), `tenant` (for tenant quotas; default the salt) and `pin: true` (the prompt is
pinned once computed, as POST /v1/cache/pin would). A first line
`{"meta": {"block_size": 512}}` sets the hash-id block size.

Hash ids become tokens deterministically: block i of a request whose hash id is h is the token h
repeated (the last block cut to `input_length`). The same hash id gives the same tokens, different
hash ids give different tokens, and the tokens then go through the same chained block hashing as
any prompt. (The token values mean nothing; only their identity matters to a cache.) Generated
tokens that a trace does not list are synthetic and unique per request: -(request index + 1),
repeated, so they can never match anything else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.utils.jsonl import read_jsonl

_MAX_TOKEN = 2**62  # token ids are hashed as int64; larger hash ids are renumbered above this


@dataclass(slots=True)
class TraceRequest:
    input_length: int
    output_length: int = 1
    timestamp: float | None = None  # seconds
    token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    cache_salt: str | None = None
    priority: int = 0
    control: dict | None = None  # kv_retention, cache_control, tenant, pin (as in the record)


_CONTROL_FIELDS = ("kv_retention", "cache_control", "tenant", "pin")


@dataclass
class Trace:
    requests: list[TraceRequest]
    block_size: int = 512  # tokens per hash id, for hash-id records
    source: str = ""
    params: dict = field(default_factory=dict)  # a generator's parameters

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def has_timestamps(self) -> bool:
        return bool(self.requests) and all(r.timestamp is not None for r in self.requests)

    @property
    def is_hash_trace(self) -> bool:
        return any(r.hash_ids is not None for r in self.requests)

    def prompt_tokens(self, rec: TraceRequest) -> list[int]:
        if rec.token_ids is not None:
            return rec.token_ids
        bs = self.block_size
        out: list[int] = []
        left = rec.input_length
        for h in rec.hash_ids:
            take = bs if left >= bs else left
            out += [h] * take
            left -= take
        return out

    def summary(self) -> dict:
        n = len(self.requests)
        inp = sum(r.input_length for r in self.requests)
        out = sum(r.output_length for r in self.requests)
        span = None
        if self.has_timestamps and n > 1:
            span = self.requests[-1].timestamp - self.requests[0].timestamp
        return dict(source=self.source, num_requests=n, input_tokens=inp, output_tokens=out,
                    mean_input_length=inp / n if n else 0.0,
                    mean_output_length=out / n if n else 0.0,
                    hash_block_size=self.block_size if self.is_hash_trace else None,
                    duration_s=span, params=self.params)

    def with_poisson_arrivals(self, rate: float, seed: int = 0) -> "Trace":
        """The same requests arriving as a Poisson process of `rate` requests per second."""
        import random

        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        rng = random.Random(seed)
        t = 0.0
        for r in self.requests:
            t += rng.expovariate(rate)
            r.timestamp = t
        return self


def _int_list(value, what: str, line: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in value):
        raise ValueError(f"line {line}: {what} must be a list of integers")
    return value


def parse_record(d: dict, line: int, block_size: int, time_scale: float,
                 renumber: dict[int, int]) -> TraceRequest:
    if not isinstance(d, dict):
        raise ValueError(f"line {line}: a record must be a JSON object")
    out_ids = d.get("output_token_ids")
    if out_ids is not None:
        out_ids = _int_list(out_ids, "output_token_ids", line)
    out_len = d.get("output_length")
    if out_len is None:
        out_len = len(out_ids) if out_ids is not None else 1
    if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 0:
        raise ValueError(f"line {line}: output_length must be an integer >= 0, got {out_len!r}")
    ts = d.get("timestamp")
    if ts is not None:
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise ValueError(f"line {line}: timestamp must be a number, got {ts!r}")
        ts = float(ts) * time_scale
    salt = d.get("cache_salt")
    priority = int(d.get("priority") or 0)
    control = {k: d[k] for k in _CONTROL_FIELDS if d.get(k) is not None} or None
    tokens = d.get("token_ids", d.get("prompt_token_ids"))
    if tokens is not None:
        tokens = _int_list(tokens, "token_ids", line)
        if not tokens:
            raise ValueError(f"line {line}: token_ids is empty")
        return TraceRequest(len(tokens), out_len, ts, tokens, None, out_ids, salt, priority,
                            control)
    hashes = d.get("hash_ids")
    if hashes is None:
        raise ValueError(f"line {line}: a record needs token_ids or hash_ids")
    hashes = _int_list(hashes, "hash_ids", line)
    if not hashes:
        raise ValueError(f"line {line}: hash_ids is empty")
    n = d.get("input_length")
    n = len(hashes) * block_size if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or \
            not (len(hashes) - 1) * block_size < n <= len(hashes) * block_size:
        raise ValueError(f"line {line}: input_length {n!r} does not fit {len(hashes)} hash ids "
                         f"of {block_size} tokens")
    if any(not 0 <= h < _MAX_TOKEN for h in hashes):
        hashes = [h if 0 <= h < _MAX_TOKEN else
                  renumber.setdefault(h, _MAX_TOKEN + len(renumber)) for h in hashes]
    return TraceRequest(n, out_len, ts, None, hashes, out_ids, salt, priority, control)


def load_trace(path: str | Path, block_size: int | None = None, time_unit: str = "ms",
               limit: int | None = None) -> Trace:
    """Read a JSONL trace; records are sorted by timestamp when every record has one."""
    scale = {"ms": 1e-3, "s": 1.0, "us": 1e-6}.get(time_unit)
    if scale is None:
        raise ValueError(f"time unit must be ms, s or us, got {time_unit!r}")
    requests: list[TraceRequest] = []
    renumber: dict[int, int] = {}
    bs = block_size
    for i, d in read_jsonl(path, "trace"):
        if isinstance(d, dict) and "meta" in d and len(d) == 1:
            if bs is None and d["meta"].get("block_size"):
                bs = int(d["meta"]["block_size"])
            continue
        requests.append(parse_record(d, i, bs or 512, scale, renumber))
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise ValueError(f"trace {str(path)!r} holds no requests")
    trace = Trace(requests, bs or 512, str(path))
    if trace.has_timestamps:
        requests.sort(key=lambda r: r.timestamp)
    return trace


def write_trace(trace: Trace, path: str | Path, time_unit: str = "ms") -> None:
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[time_unit]
    with open(path, "w", encoding="utf-8") as f:
        if trace.is_hash_trace:
            f.write(json.dumps({"meta": {"block_size": trace.block_size}}) + "\n")
        for r in trace.requests:
            d: dict = {}
            if r.timestamp is not None:
                d["timestamp"] = round(r.timestamp * scale, 3)
            if r.token_ids is not None:
                d["token_ids"] = r.token_ids
            else:
                d["input_length"] = r.input_length
                d["hash_ids"] = r.hash_ids
            d["output_length"] = r.output_length
            if r.output_token_ids is not None:
                d["output_token_ids"] = r.output_token_ids
            if r.cache_salt is not None:
                d["cache_salt"] = r.cache_salt
            if r.priority:
                d["priority"] = r.priority
            d.update(r.control or {})
            f.write(json.dumps(d, separators=(",", ":")) + "\n")


def from_token_lists(prompts: Iterable[Sequence[int]], output_length: int = 1) -> Trace:
    """A trace of token-id prompts, in order, without timestamps."""
    reqs = [TraceRequest(len(p), output_length, None, list(p)) for p in prompts]
    return Trace(reqs, source="token lists")
