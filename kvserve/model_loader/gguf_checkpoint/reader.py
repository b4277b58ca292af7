"""A GGUF file's header, read once with `gguf` (the llama.cpp project's own reader) and kept.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array: on a model
with a 49k-token vocabulary that is ~250k views and 4–13 s, longer than loading the weights.
So the first open reads the file with it and writes what the engine needs of the header to the
cache (`GGUFIndex`: scalar metadata, the tokenizer arrays, and each tensor's type, shape and
byte range); later opens of the same file (same path, size and mtime) read that JSON and map
the tensor data straight from the file. Every problem with the file is a `ValueError` naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.utils.paths import cache_dir

logger = logging.getLogger("kvserve")

GGUF_MAGIC = b"GGUF"
# Bump when what the index holds, or how the sidecar files are written, changes.
INDEX_VERSION = 3
# Metadata arrays kept whole (the tokenizer's); every other array is kept only when short.
_KEPT_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.scores")
_SHORT_ARRAY = 4096


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its GGUF name, ggml type name ("Q4_1", "F32", ...), shape in torch order
    (rows first) and where its bytes lie in the file."""
    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class GGUFIndex:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """A file whose first four bytes are GGUF's magic (the suffix alone is not trusted)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def cache_key(path: Path) -> str:
    """Names one version of one file: its real path, size and modification time."""
    st = path.stat()
    ident = f"{INDEX_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return f"{path.stem[:40]}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def sidecar_dir(path: Path) -> Path:
    """Where the index and the Hugging Face files made from this GGUF's metadata live."""
    return cache_dir() / "gguf" / cache_key(path)


def read_index(path: str | os.PathLike[str]) -> GGUFIndex:
    """The header of the GGUF at `path`, from the cache when this version of the file was read
    before, else read with `gguf` (and cached when the cache is writable)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    cached = sidecar_dir(path) / "index.json"
    if cached.is_file():
        try:
            return _index_from_json(path, json.loads(cached.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable GGUF index %s (%s): reading the file again",
                           cached, e)
    index = _read_with_gguf(path)
    _store_json(cached, _index_to_json(index))
    return index


def _read_with_gguf(path: Path) -> GGUFIndex:
    if not is_gguf(path):
        raise ValueError(f"{str(path)!r} is not a GGUF file (its first bytes are not 'GGUF')")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, IndexError, struct or numpy errors
        raise ValueError(f"cannot read GGUF file {str(path)!r} (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from e
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if len(field.types) > 1 and field.types[0] == gguf.GGUFValueType.ARRAY \
                and name not in _KEPT_ARRAYS and len(field.data) > _SHORT_ARRAY:
            metadata[name] = {"array_length": len(field.data)}
            continue
        try:
            value = field.contents()
        except Exception as e:
            raise ValueError(f"GGUF file {str(path)!r}: cannot read metadata {name!r}: {e}") \
                from e
        metadata[name] = _plain(value)
    size = path.stat().st_size
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        offset = int(t.data_offset)
        nbytes = int(t.n_bytes)
        if offset + nbytes > size:
            raise ValueError(f"GGUF file {str(path)!r} is truncated: tensor {t.name!r} needs "
                             f"bytes up to {offset + nbytes:,}, the file has {size:,}")
        tensors[t.name] = TensorInfo(t.name, t.tensor_type.name,
                                     tuple(int(n) for n in reversed(t.shape.tolist())),
                                     offset, nbytes)
    return GGUFIndex(path, metadata, tensors)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON-able Python values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _index_to_json(index: GGUFIndex) -> dict[str, Any]:
    st = index.path.stat()
    return {"version": INDEX_VERSION, "size": st.st_size, "metadata": index.metadata,
            "tensors": [[t.name, t.type_name, list(t.shape), t.offset, t.nbytes]
                        for t in index.tensors.values()]}


def _index_from_json(path: Path, data: dict[str, Any]) -> GGUFIndex:
    if data.get("version") != INDEX_VERSION or data.get("size") != path.stat().st_size:
        raise ValueError("stale index")
    tensors = {name: TensorInfo(name, type_name, tuple(shape), offset, nbytes)
               for name, type_name, shape, offset, nbytes in data["tensors"]}
    return GGUFIndex(path, dict(data["metadata"]), tensors)


def _store_json(dest: Path, data: dict[str, Any]) -> None:
    """A cache that cannot be written only costs the next start its speed."""
    try:
        write_atomic(dest, json.dumps(data))
    except OSError as e:
        logger.warning("could not cache the GGUF index at %s: %s", dest, e)


def write_atomic(dest: Path, text: str) -> None:
    """Written to a temporary file beside `dest` and renamed, so a reader (another process
    opening the same file) never sees half of it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}-", dir=dest.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, dest)


class TensorData:
    """The file mapped once; each tensor's bytes are a view into it (dequant.py turns them into
    float32)."""

    def __init__(self, index: GGUFIndex) -> None:
        self.index = index
        self._map = np.memmap(index.path, dtype=np.uint8, mode="r")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored (a block format's blocks, row by row)."""
        return self._map[info.offset: info.offset + info.nbytes]

    def read_into(self, info: TensorInfo, start: int, out: np.ndarray) -> None:
        """Bytes start .. start + out.nbytes of the tensor into `out` (contiguous) with pread,
        not through the map: a mapped page the copy touched counts in the process's RSS until
        the map goes, so a load through it peaked at twice the file (the blocks kept plus the
        file's pages), where reads leave the file's pages to the page cache."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done, at = 0, info.offset + start
        with open(self.index.path, "rb", buffering=0) as f:
            while done < view.nbytes:
                n = os.preadv(f.fileno(), [view[done:]], at + done)
                if n <= 0:
                    raise ValueError(f"GGUF file {str(self.index.path)!r} ends inside "
                                     f"tensor {info.name!r}")
                done += n


def check_types(index: GGUFIndex) -> None:
    """Refuse, before anything is allocated, a tensor whose type `gguf` cannot dequantize
    (Q8_K, Q8_1, the integer types, ...), naming the first such tensor."""
    import gguf

    readable: dict[str, bool] = {}
    for info in index.tensors.values():
        if info.type_name not in readable:
            readable[info.type_name] = _dequantizable(gguf, info.type_name)
        if not readable[info.type_name]:
            raise ValueError(f"GGUF file {str(index.path)!r}: tensor {info.name!r} has ggml "
                             f"type {info.type_name}, which kvserve cannot load (it reads F32, "
                             "F16, BF16 and every block format gguf can dequantize: Q4_0, "
                             "Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types)")


def _dequantizable(gguf, type_name: str) -> bool:
    if type_name in ("F32", "F16", "BF16"):
        return True
    try:
        qtype = gguf.GGMLQuantizationType[type_name]
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
    except (KeyError, NotImplementedError):
        return False
    return True
