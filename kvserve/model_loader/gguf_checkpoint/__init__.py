"""GGUF checkpoints (llama.cpp's single-file format) through the same path as a safetensors
directory: the header becomes a "sidecar" Hugging Face directory in kvserve's cache
(config.json, tokenizer.json, tokenizer_config.json, generation_config.json), which
`ModelConfig.from_dir`, `Tokenizer.from_dir` and the planner read as they read any checkpoint;
the tensors are read from the file by `GGUFCheckpoint.tensors`, each as a `GGUFTensor` that the
loader dequantizes into the model dtype. The raw blocks stay reachable (`GGUFTensor.raw`), so
a quantized linear layer can take them as they are later.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvserve.model_loader.gguf_checkpoint import arch as _arch
from kvserve.model_loader.gguf_checkpoint.reader import (TensorData, TensorInfo, check_types,
                                                         is_gguf, read_index, sidecar_dir,
                                                         write_atomic)
from kvserve.model_loader.gguf_checkpoint.tokenizer import has_tokenizer, tokenizer_files

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFCheckpoint", "GGUFTensor", "is_gguf", "open_gguf", "tokenizer_dir"]


@dataclass
class GGUFTensor:
    """One tensor under its checkpoint name, read when asked: `names`, every checkpoint name
    llama.cpp's converter maps to it (`name` the first; the loader takes the one its
    architecture's weight map has), and for a stacked experts tensor one `expert`'s rows."""
    name: str  # the Hugging Face checkpoint name
    info: TensorInfo
    _data: TensorData
    _unpermute_heads: int | None = None
    names: tuple[str, ...] = ()
    expert: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape if self.expert is None else self.info.shape[1:]

    def raw(self) -> np.ndarray:
        raw = self._data.raw(self.info)
        if self.expert is None:
            return raw
        per = self.info.shape[1]  # an expert's rows, whole blocks each
        rows = np.asarray(raw).reshape(self.info.shape[0] * per, -1)
        return rows[self.expert * per: (self.expert + 1) * per]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of one expert's rows for a stacked experts tensor)."""
        rows = self.info.shape[0] * (1 if self.expert is None else self.info.shape[1])
        return self.info.nbytes // rows

    def read(self) -> np.ndarray:
        """The tensor's bytes (one expert's for a stacked experts tensor) in a new buffer,
        read with pread: a load that read the file's map kept every page it touched in the
        process's RSS until the map went (a BF16 file peaked at its float32 model plus the
        whole file), where a read leaves the file's pages to the page cache."""
        if self.expert is None:
            out = np.empty(self.info.nbytes, dtype=np.uint8)
            self._data.read_into(self.info, 0, out)
            return out
        rows = self.info.shape[1]
        out = np.empty(rows * self.row_bytes, dtype=np.uint8)
        self._data.read_into(self.info, self.expert * rows * self.row_bytes, out)
        return out

    def raw_rows(self, out: np.ndarray | None = None) -> np.ndarray:
        """The blocks of a 2-D tensor as uint8 [rows, bytes per row] (a copy: into `out`
        where given, with no copy between), with llama.cpp's q/k row permutation undone:
        blocks never cross a row, so whole rows move as in `dequantize`."""
        rows = self.shape[0]
        if out is None:
            out = np.empty((rows, self.row_bytes), dtype=np.uint8)
        start = 0 if self.expert is None else self.expert * rows * self.row_bytes
        if self._unpermute_heads is None:
            self._data.read_into(self.info, start, out)
        else:
            raw = np.empty_like(out)
            self._data.read_into(self.info, start, raw)
            _arch.unpermute_rows(raw, self._unpermute_heads, out)
        return out

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor as float32, dequantizing only those (a
        tensor-parallel rank's slice: the whole tensor is never expanded to float)."""
        from kvserve.model_loader.gguf_checkpoint.dequant import dequantize

        rows = self.raw_rows()[start:stop]
        return dequantize(rows.reshape(-1), self.info.type_name,
                          (stop - start, *self.shape[1:]), self.info.name)

    def dequantize(self) -> torch.Tensor:
        """float32, with llama.cpp's q/k row permutation undone (torch is imported here, not
        above: the planner reads GGUF headers without it)."""
        from kvserve.model_loader.gguf_checkpoint.dequant import dequantize

        w = dequantize(self.read(), self.info.type_name, self.shape, self.info.name)
        if self._unpermute_heads is not None:
            w = _arch.unpermute_rows(w, self._unpermute_heads)
        return w


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = read_index(path)
        self.architecture = _arch.check_architecture(self.index.metadata)
        check_types(self.index)
        shapes = {name: t.shape for name, t in self.index.tensors.items()}
        freqs = self.index.tensors.get("rope_freqs.weight")
        if freqs is not None:
            if freqs.type_name != "F32":
                raise ValueError(f"GGUF rope_freqs of type {freqs.type_name} (F32 expected)")
            freqs = np.asarray(TensorData(self.index).raw(freqs)).view(np.float32)
        types = {name: (t.type_name, t.shape) for name, t in self.index.tensors.items()}
        self.config = _arch.hf_config(self.index.metadata, shapes, freqs,
                                      _arch.checkpoint_dtype(types))
        self.dir = sidecar_dir(path)
        self._write_sidecar()

    @property
    def has_tokenizer(self) -> bool:
        return has_tokenizer(self.index.metadata)

    @property
    def norms_hold_one_plus_w(self) -> bool:
        """Gemma 3 GGUFs store 1 + w, as kvserve does: no offset is added at load."""
        return self.architecture in _arch.NORMS_HOLD_ONE_PLUS_W

    def tokenizer_dir(self) -> Path:
        """The sidecar directory as a tokenizer source; a clear error when the file has none."""
        if not self.has_tokenizer:
            tokenizer_files(self.index.metadata)  # raises the ValueError that says why
        return self.dir

    def tensors(self) -> Iterator[GGUFTensor]:
        data = TensorData(self.index)
        heads = {"attn_q": self.config["num_attention_heads"],
                 "attn_k": self.config["num_key_value_heads"]}
        for gguf_name, info in self.index.tensors.items():
            if _arch.derived(self.architecture, gguf_name, self.index.tensors):
                continue
            stacked = "_exps." in gguf_name and len(info.shape) == 3
            for expert in range(info.shape[0]) if stacked else (None,):
                names = _arch.hf_names(self.architecture, gguf_name, expert)
                if not names:
                    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file "
                                     f"{str(self.path)!r} for architecture "
                                     f"{self.architecture}")
                unpermute = None
                if _arch.needs_unpermute(self.architecture, gguf_name):
                    unpermute = heads[gguf_name.split(".")[2]]
                yield GGUFTensor(names[0], info, data, unpermute, names, expert)

    def _write_sidecar(self) -> None:
        """The directory is named by the file's identity, so once complete it is never stale."""
        done = self.dir / ".complete"
        if done.is_file():
            return
        files: dict[str, dict] = {"config.json": self.config}
        if self.has_tokenizer:
            files.update(tokenizer_files(self.index.metadata))
        for name, content in files.items():
            write_atomic(self.dir / name, json.dumps(content, ensure_ascii=False, indent=1))
        done.touch()


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """One GGUFCheckpoint per version of a file (its real path, size and modification time):
    the loader, the tokenizer and the planner of one process share it."""
    p = Path(path)
    st = p.stat() if p.is_file() else None
    return _open(str(p.resolve()), st.st_size if st else -1, st.st_mtime_ns if st else -1)


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(Path(path))


def tokenizer_dir(model: str | os.PathLike[str]) -> Path:
    """Where a checkpoint's tokenizer files are: the directory itself, or for a GGUF file the
    sidecar made from its metadata (a ValueError when the file carries no tokenizer)."""
    return open_gguf(model).tokenizer_dir() if is_gguf(model) else Path(model)
