"""Sizes in and out: "80GB" is 80 x 10^9 bytes, "80GiB" is 80 x 2^30; "8k" tokens is 8,192.

Memory is sold in decimal gigabytes (an "80 GB" card, a "4.1 GB" checkpoint) and reported by
CUDA and nvidia-smi in binary units (MiB, GiB); mixing the two is the most common error in KV-cache
arithmetic (a 7% difference at the GiB scale). Every byte count the planner takes is parsed here
with the unit spelled out, and every byte count it prints shows both.
"""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
    "ti": 2**40, "tib": 2**40,
}
# Context lengths: "8K" means 8,192 in LLM usage ("8K context"), so token suffixes are binary.
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '4.1e9' -> 4100000000, 1234 -> 1234."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must not be negative, got {text}")
        return int(round(text))
    m = _NUMBER.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size in bytes; write e.g. 80GB (10^9), "
                         "80GiB (2^30), 512MiB or 4.1e9")
    return int(round(float(m.group(1)) * _BYTE_UNITS[unit]))


def parse_tokens(text: str | int) -> int:
    """'8k' -> 8192, '204800' -> 204800, '1M' -> 1048576."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _NUMBER.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _TOKEN_UNITS:
            raise ValueError(f"cannot read {text!r} as a token count; write e.g. 8192, 8k "
                             "(= 8,192) or 1M (= 1,048,576)")
        value = float(m.group(1)) * _TOKEN_UNITS[unit]
        if value != int(value):
            raise ValueError(f"a token count must be whole, got {text!r}")
        value = int(value)
    if value <= 0:
        raise ValueError(f"a token count must be positive, got {text!r}")
    return value


def parse_token_list(text: str) -> list[int]:
    """'16k,32k,64k' -> [16384, 32768, 65536]."""
    return [parse_tokens(part) for part in str(text).split(",") if part.strip()]


def fmt_bytes(n: float) -> str:
    """'234,881,024 B (234.9 MB, 224.0 MiB)': exact bytes, then decimal and binary units."""
    n = float(n)
    if abs(n) < 1000:
        return f"{n:,.0f} B"
    dec = next((u for u, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
                if abs(n) >= s), "kB")
    dscale = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3}[dec]
    binu = next((u for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                 if abs(n) >= s), "KiB")
    bscale = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[binu]
    return f"{n:,.0f} B ({n / dscale:,.1f} {dec}, {n / bscale:,.1f} {binu})"


def fmt_short(n: float) -> str:
    """A compact decimal size for tables: '234.9 MB'."""
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"
