"""What an adversary without the deployment's KV auth key can make: chunks in kvserve's own
framing whose every check but the MAC passes (tests of kv/tiers/chunk.py's authentication)."""

from __future__ import annotations

import os

import torch
import xxhash

from kvserve.kv.tiers.chunk import _FIELDS, HEADER_BYTES, encode


def rewrite_payload(blob: bytes, fill: int = 0) -> bytes:
    """`blob` with its payload overwritten by `fill` bytes and the checksum recomputed to match:
    magic, version, key, dtype, shape, lengths and checksum all pass; the MAC is the old one."""
    fields = list(_FIELDS.unpack_from(blob))
    payload = bytes([fill]) * (len(blob) - HEADER_BYTES)
    fields[-1] = xxhash.xxh3_64_intdigest(payload)
    return _FIELDS.pack(*fields) + blob[_FIELDS.size:HEADER_BYTES] + payload


def foreign_chunk(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """A well-framed chunk of zeros for `key`, MAC'd with a key nobody else has."""
    return encode(key, torch.zeros(shape, dtype=dtype), auth_key=os.urandom(32))
