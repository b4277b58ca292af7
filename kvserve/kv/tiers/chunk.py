"""What a stored chunk is called and how it is written down.

A chunk is the KV of `chunk_size` consecutive tokens, every layer, K and V: a tensor
[layers, 2, chunk_size, kv_heads, head_dim]. Its name is the chained hash of its last block (which
already covers every token before it and the cache_salt) plus a digest of everything else that
makes two KV tensors incompatible: the model, the KV dtype and layout, the block and chunk sizes.
So different models, dtypes or tenants never read each other's chunks.

Leaving process memory (disk, Redis, a transfer to another instance), a chunk is framed with a
magic number, a format version, its own key, its dtype and shape, the payload length, an xxh3
checksum of the payload and a MAC over all of that, the key and the payload, keyed by the
deployment's secret (auth.py says which MAC, and why). The checksum catches accidents: a
truncated, corrupted, misplaced or foreign chunk is recognised and dropped, never loaded.
Only the MAC catches an adversary, since anyone can recompute a checksum: a chunk planted in a
shared directory or Redis, or served by a fake producer, fails it (`ChunkAuthError`) and is a
miss.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import xxhash

from kvserve.kv.tiers.auth import MAC_BYTES, mac_seal, mac_verify
MAGIC = b"KVSC"
FORMAT_VERSION = 2  # 2: the MAC; version 1 chunks (unauthenticated) are never read
# magic ver serde dtype key shape[5] raw payload checksum, then the MAC (nonce and tag)
_FIELDS = struct.Struct("<4sHBB16s5IQQQ")
HEADER_BYTES = _FIELDS.size + MAC_BYTES
_SERDE_IDS = {"naive": 0, "zlib": 1}
_DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3,
              torch.uint8: 4, torch.float8_e4m3fn: 5, torch.float8_e5m2: 6}
_DTYPES = {v: k for k, v in _DTYPE_IDS.items()}


class CorruptChunkError(ValueError):
    """A stored chunk failed its checks (magic, version, key, shape, length or checksum)."""


class ChunkAuthError(CorruptChunkError):
    """A well-formed chunk whose MAC does not verify: not written with this deployment's key
    (planted, forged, or from a deployment configured with another key)."""


@dataclass(frozen=True)
class ChunkIdentity:
    """Everything besides the token prefix that a chunk's KV depends on."""

    model: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    chunk_size: int
    tensors_per_layer: int = 2  # K and V; 1 for MLA's latent vector (then heads 1, its width)
    # The KV pool's storage format (KVTensorPool.format_tag: dtype, groups, fp8 scales).
    kv_format: str = ""
    # Set for a packed (int8/int4) pool: a chunk is [layers, 1, blocks, 1, page_bytes] uint8.
    page_bytes: int | None = None
    # Tensor parallelism: each rank's part of a chunk (KV heads, or a packed page's bytes),
    # side by side in rank order; () for one process. Another layout never reads these chunks.
    rank_parts: tuple[int, ...] = ()

    @cached_property
    def digest(self) -> str:
        # Each extension adds fields only when it departs from the default, so the keys of
        # plain K/V chunks stay what they were.
        fields = [self.model, str(self.dtype), self.num_layers, self.num_kv_heads, self.head_dim,
                  self.block_size, self.chunk_size, FORMAT_VERSION]
        if self.tensors_per_layer != 2:
            fields += [self.tensors_per_layer]
        if self.kv_format:
            fields += [self.kv_format, self.page_bytes]
        if self.rank_parts:
            fields += ["tp", list(self.rank_parts)]
        return xxhash.xxh3_64_hexdigest(json.dumps(fields).encode())

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        if self.page_bytes is not None:
            return (self.num_layers, 1, self.chunk_size // self.block_size, 1, self.page_bytes)
        return (self.num_layers, self.tensors_per_layer, self.chunk_size, self.num_kv_heads,
                self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()

    def key(self, chunk_hash: int) -> str:
        """The storage key of the chunk whose last block has this chained hash."""
        return f"kvserve:{self.digest}:{chunk_hash:032x}"


def model_fingerprint(model_dir: str) -> str:
    """A cheap identity of a checkpoint's contents: config.json, and each weights file's size,
    header and a sample of its data (a GGUF path: that one file's). Copies of one checkpoint
    agree wherever they live; two random-weight models with the same config do not."""
    h = xxhash.xxh3_128()
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read())
    weights = [model_dir] if os.path.isfile(model_dir) else \
        sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    for path in weights:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 16))  # 8-byte length + JSON header (names, shapes, offsets)
            f.seek(max(0, size // 2))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _key_digest(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode())


def encode(key: str, data: torch.Tensor, serde: str = "naive", *, auth_key: bytes) -> bytes:
    """Frame and authenticate a chunk tensor for disk, Redis or a transfer."""
    data = data.contiguous()
    raw = data.view(torch.uint8).numpy().tobytes() if data.dtype != torch.uint8 \
        else data.numpy().tobytes()
    if serde == "zlib":
        # Float bytes compress badly as they come; grouped by byte position (all exponents, then
        # all high mantissa bytes, ...) the exponent plane is highly repetitive.
        planes = np.frombuffer(raw, np.uint8).reshape(-1, data.element_size()).T.tobytes()
        payload = zlib.compress(planes, 1)
    elif serde == "naive":
        payload = raw
    else:
        raise ValueError(f"unknown serde {serde!r}")
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, _SERDE_IDS[serde], _DTYPE_IDS[data.dtype],
                          _key_digest(key), *data.shape, len(raw), len(payload),
                          xxhash.xxh3_64_intdigest(payload))
    return fields + mac_seal(auth_key, (fields, key.encode(), payload)) + payload


def decode(key: str, blob: bytes, dtype: torch.dtype,
           shape: tuple[int, int, int, int, int], *, auth_key: bytes) -> torch.Tensor:
    """Check, authenticate and unframe a stored chunk; CorruptChunkError on any mismatch
    (ChunkAuthError when only the MAC fails). The MAC is checked before the payload is
    decompressed or turned into a tensor: nothing unauthenticated is interpreted."""
    if len(blob) < HEADER_BYTES:
        raise CorruptChunkError(f"chunk {key} is truncated ({len(blob)} bytes)")
    (magic, version, serde_id, dtype_id, key_digest, *rest) = _FIELDS.unpack_from(blob)
    stored_shape, (raw_len, payload_len, checksum) = tuple(rest[:5]), rest[5:]
    if magic != MAGIC:
        raise CorruptChunkError(f"chunk {key} has no chunk header")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(f"chunk {key} has format version {version}, "
                                f"this build reads {FORMAT_VERSION}")
    if key_digest != _key_digest(key):
        raise CorruptChunkError(f"chunk stored under {key} belongs to another key")
    if _DTYPES.get(dtype_id) != dtype or stored_shape != tuple(shape):
        raise CorruptChunkError(f"chunk {key} is {_DTYPES.get(dtype_id)} {stored_shape}, "
                                f"expected {dtype} {tuple(shape)}")
    view = memoryview(blob)
    payload = view[HEADER_BYTES:]
    if len(payload) != payload_len:
        raise CorruptChunkError(f"chunk {key} is truncated: {len(payload)} of {payload_len} "
                                "payload bytes")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptChunkError(f"chunk {key} fails its checksum")
    # The header holds only the key's 128-bit xxh3, which is no commitment: the MAC covers the
    # full key (the fields' fixed size and payload length keep the three parts unambiguous).
    sealed = view[_FIELDS.size:HEADER_BYTES]
    if not mac_verify(auth_key, (view[:_FIELDS.size], key.encode(), payload), sealed):
        raise ChunkAuthError(f"chunk {key} fails its MAC (not written with this deployment's "
                             "KV auth key)")
    elem = torch.empty(0, dtype=dtype).element_size()
    if serde_id == _SERDE_IDS["zlib"]:
        try:
            planes = zlib.decompress(payload)
        except zlib.error as e:
            raise CorruptChunkError(f"chunk {key} does not decompress: {e}") from None
        raw = np.frombuffer(planes, np.uint8).reshape(elem, -1).T.copy()
    elif serde_id == _SERDE_IDS["naive"]:
        raw = np.frombuffer(payload, np.uint8).copy()
    else:
        raise CorruptChunkError(f"chunk {key} has unknown serde id {serde_id}")
    if raw.size != raw_len or raw_len != elem * int(np.prod(shape)):
        raise CorruptChunkError(f"chunk {key} holds {raw.size} bytes, expected {raw_len}")
    return torch.from_numpy(raw.reshape(-1)).view(dtype).reshape(shape)
