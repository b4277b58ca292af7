"""Paged attention through the Triton kernels: the GPU backend.

Per step, `prepare` turns the runner's metadata into a few small int32 device tensors (block
tables, lengths, query offsets) once; every layer then runs three launches at most: store the new
K/V, one extend launch for all prefill chunks, one split-K decode (+ merge) for all decodes.

The same code runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how
the engine is tested end to end without a GPU; it is far too slow for anything else on a CPU.

A decode-only step can also be described by `DecodeState`s whose tensors are static buffers
owned by the CUDA-graph runner (`kvserve.worker.cuda_graphs`), so a captured graph replays with
new block tables and lengths copied into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.utils import features as F
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention import triton_kernels as tk
from kvserve.attention.base import (AttentionBackend, AttentionMetadata, SequenceSlice,
                                    padded_block_tables)
from kvserve.kernels.gpu.interpreter import INTERPRETED


@dataclass
class PrefillState:
    """Every prefill chunk of the step, for one extend launch."""

    block_tables: torch.Tensor  # [S, max_blocks] int32
    q_starts: torch.Tensor  # [S] int32: first row of each sequence in the flat batch
    q_lens: torch.Tensor  # [S] int32
    seq_lens: torch.Tensor  # [S] int32: cached prefix + new tokens
    max_query_len: int
    num_tokens: int


@dataclass
class DecodeState:
    """The decode tail of the step (one row per sequence, after the prefill rows)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int64
    num_splits: int  # split-K factor; fixed per CUDA-graph bucket


@dataclass
class TritonStepState:
    slot_mapping: torch.Tensor  # [T] int64 on the cache's device; -1 = padding (not stored)
    prefill: PrefillState | None
    decode: DecodeState | None


class TritonAttentionBackend(AttentionBackend):
    observes_attention = False  # fused kernels, no attention weights: no SnapKV / H2O

    def __init__(self, pool: KVTensorPool, scale: float) -> None:
        super().__init__(pool, scale)
        if pool.block_state is not None:  # int4's residual rows, the one format with any
            F.refuse(F.INT4, F.TRITON_BACKEND)
        self.quant = [_quant_of(pool, layer) for layer in range(len(pool.layers))]
        # Layers whose fp8 scales the first batch still has to calculate (calculate_kv_scales):
        # their QuantKV is read again after their first store, the others' never.
        scales = pool.scales
        self._uncalibrated = set() if scales is None else \
            {layer for layer, done in enumerate(scales.calibrated) if not done}
        k0, v0 = self.kv_caches[0][:2]
        tk.check_kv_cache(k0, v0, self.quant[0])
        self.device = k0.device
        if self.device.type == "cpu" and not INTERPRETED:
            raise ValueError("the Triton backend runs on CPU tensors only under Triton's "
                             "interpreter (TRITON_INTERPRET=1 set before triton is imported); "
                             "use attention_backend='torch' on the CPU")
        self.num_kv_heads = pool.codecs[0].heads
        self.head_dim = pool.codecs[0].head_dim
        # Each tensor once: under page groups (a hybrid layout) layers share them.
        self._pointer_table = None if pool.quantized else tk.cache_pointer_table(pool.storage())

    # -- per step ---------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> TritonStepState:
        slots = meta.slot_mapping.to(self.device, non_blocking=True)
        prefill = self._prefill_state(meta.prefills) if meta.prefills else None
        decode = None
        if meta.decodes:
            max_len = max(s.seq_len for s in meta.decodes)
            tables, _ = self._tables(meta.decodes)
            # int64 lengths, as in the CUDA-graph buffers: one compiled kernel serves both.
            lens = torch.tensor([s.seq_len for s in meta.decodes], dtype=torch.int64)
            decode = DecodeState(tables, lens.to(self.device, non_blocking=True),
                                 tk.decode_splits(len(meta.decodes), self.num_kv_heads,
                                                  max_len))
        return TritonStepState(slots, prefill, decode)

    def _prefill_state(self, seqs: list[SequenceSlice]) -> PrefillState:
        tables, info = self._tables(seqs)
        return PrefillState(tables, info[:, 1].contiguous(), info[:, 2].contiguous(),
                            info[:, 0].contiguous(), max(s.query_len for s in seqs),
                            sum(s.query_len for s in seqs))

    def _tables(self, seqs: list[SequenceSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [S, max_blocks] and (seq_len, start, query_len) [S, 3], int32, built on
        the host in one go and sent over in two copies."""
        tables = torch.tensor(padded_block_tables(seqs, self.block_size), dtype=torch.int32)
        info = torch.tensor([(s.seq_len, s.start, s.query_len) for s in seqs], dtype=torch.int32)
        return (tables.to(self.device, non_blocking=True),
                info.to(self.device, non_blocking=True))

    # -- per layer --------------------------------------------------------------------------
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, state: TritonStepState) -> torch.Tensor:
        return self.attend(layer_idx, q, k, v, state)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               state: TritonStepState) -> torch.Tensor:
        """Store k/v, then attention for the prefill rows and the decode tail. Depends only on
        `state` (no host metadata), so the CUDA-graph runner can capture it."""
        k_cache, v_cache = self.kv_caches[layer_idx][:2]
        window = self.windows[layer_idx]
        quant = self.quant[layer_idx]
        if quant.kind == tk.KV_PLAIN:
            tk.store_kv(k, v, k_cache, v_cache, state.slot_mapping)
        else:  # quantized by the pool's codec (no CUDA graphs: slots are never padding here)
            self.pool.store(layer_idx, k, v, state.slot_mapping)
            if layer_idx in self._uncalibrated and self.pool.scales.calibrated[layer_idx]:
                quant = self.quant[layer_idx] = _quant_of(self.pool, layer_idx)
                self._uncalibrated.discard(layer_idx)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        p = state.prefill
        if p is not None:
            tk.extend_attention(q, k_cache, v_cache, p.block_tables, p.q_starts, p.q_lens,
                                p.seq_lens, p.max_query_len, self.scale, out=out,
                                window=window, quant=quant)
        d = state.decode
        if d is not None:
            start = 0 if p is None else p.num_tokens
            tk.decode_attention(q[start:], k_cache, v_cache, d.block_tables, d.seq_lens,
                                self.scale, out=out[start:], num_splits=d.num_splits,
                                window=window, quant=quant)
        return out

    # -- block copies -------------------------------------------------------------------------
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write of shared blocks: every layer's K and V in one launch."""
        if not src:
            return
        if self.pool.quantized:  # parts of several shapes: the pool copies them
            self.pool.copy_blocks(src, dst)
            return
        s = torch.tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        d = torch.tensor(dst, dtype=torch.int64).to(self.device, non_blocking=True)
        tk.copy_blocks(self.pool.storage(), s, d, self._pointer_table)


def _quant_of(pool: KVTensorPool, layer: int) -> tk.QuantKV:
    """How the kernels read this layer's cache (kv/quant.py's layouts)."""
    codec = pool.codecs[layer]
    dtype = codec.storage.dtype
    if dtype in ("fp8", "fp8_e5m2"):
        ks, vs = pool.scales.get(layer)
        kind = tk.KV_FP8_E4M3 if dtype == "fp8" else tk.KV_FP8_E5M2
        return tk.QuantKV(kind, ks, vs)
    if dtype == "int8":
        parts = pool.layers[layer]
        return tk.QuantKV(tk.KV_INT8, k_sz=parts[2], v_sz=parts[3],
                          group_dim=codec.head_dim // codec.groups)
    return tk.PLAIN
