"""CUDA graphs for decode-only steps: one graph launch instead of hundreds of kernel launches.

A decode step of a small model (or of a big one at batch 1) is bound by launch overhead, not by
the GPU: each layer is a dozen small kernels. So the whole forward of a decode-only batch is
captured once per bucketed batch size (1, 2, 4, 8, then multiples of 16 up to `max_num_seqs`,
at most 512), reading its inputs from static buffers. A step copies its token ids, positions,
slots, lengths and block tables into those buffers (two host-to-device copies), pads the batch
up to the next bucket (padding rows store nothing: slot -1, and attend to one token), replays the
graph, and returns the first n rows of the captured output.

The split-K factor of decode attention is part of the captured launch, so it is fixed per bucket
from `max_model_len` rather than from each step's longest sequence; the kernel then spreads each
sequence's real length over those splits (empty splits cost one masked program each).

Graphs are captured at engine start-up (largest first, sharing one memory pool, as vLLM does)
after the KV pool is allocated; `enforce_eager=True` turns all of this off.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from kvserve.attention.base import AttentionMetadata, padded_block_tables
from kvserve.attention.triton_backend import (DecodeState, TritonAttentionBackend,
                                              TritonStepState)
from kvserve.attention.triton_kernels import decode_splits
from kvserve.models.decoder import CausalLM

logger = logging.getLogger("kvserve")

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to min(max_num_seqs, 512), which is always included."""
    cap = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in [1, 2, 4, 8] + list(range(16, MAX_GRAPH_BATCH + 1, 16)) if b < cap]
    return sizes + [cap]


class CUDAGraphRunner:
    """Captures and replays the model's forward for decode-only batches."""

    def __init__(self, model: CausalLM, backend: TritonAttentionBackend, max_num_seqs: int,
                 max_model_len: int) -> None:
        if not isinstance(backend, TritonAttentionBackend):
            raise ValueError("CUDA graphs need the Triton attention backend")
        self.model = model
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        device = backend.device
        max_blocks = -(-max_model_len // backend.block_size)
        # Rows: token ids, positions, slots, sequence lengths (int64; the kernels read any int).
        self._inputs = torch.zeros(4, self.max_batch, dtype=torch.long, device=device)
        self._inputs[2].fill_(-1)
        self._inputs[3].fill_(1)
        self._tables = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: object | None = None

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch

    def bucket(self, num_seqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    # -- capture ----------------------------------------------------------------------------
    def _state(self, bs: int) -> TritonStepState:
        splits = decode_splits(bs, self.backend.num_kv_heads, self.max_model_len)
        return TritonStepState(self._inputs[2, :bs], None,
                               DecodeState(self._tables[:bs], self._inputs[3, :bs], splits))

    @torch.inference_mode()
    def capture(self, bs: int) -> None:
        """Warm up (compiles the Triton kernels, picks cuBLAS algorithms) on a side stream, then
        capture. Padding inputs only: slot -1 writes nothing to the KV pool."""
        self._inputs[:2, :bs].zero_()
        self._inputs[2, :bs].fill_(-1)
        self._inputs[3, :bs].fill_(1)
        state = self._state(bs)

        def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
            return self.backend.attend(layer_idx, q, k, v, state)

        ids, positions = self._inputs[0, :bs], self._inputs[1, :bs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(ids, positions, attn)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(ids, positions, attn)
        self._pool = graph.pool()
        self._graphs[bs] = graph
        self._outputs[bs] = out

    def capture_all(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        for bs in reversed(self.batch_sizes):  # largest first: the shared pool fits them all
            self.capture(bs)
        torch.cuda.synchronize()
        logger.info("Captured %d CUDA graphs (batch sizes %s..%s) in %.1f s, %.0f MiB",
                    len(self._graphs), self.batch_sizes[0], self.batch_sizes[-1],
                    time.perf_counter() - start,
                    (torch.cuda.memory_allocated() - before) / 2**20)

    # -- replay -----------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch (CPU input tensors). The result is a
        view into the graph's output buffer: valid until the next replay."""
        n = len(meta.decodes)
        bs = self.bucket(n)
        if bs not in self._graphs:
            self.capture(bs)
        bsz = self.backend.block_size
        host = torch.empty(4, bs, dtype=torch.long)
        host[0, :n] = input_ids
        host[1, :n] = positions
        host[2, :n] = meta.slot_mapping
        host[3, :n] = torch.tensor([s.seq_len for s in meta.decodes], dtype=torch.long)
        host[0:2, n:] = 0
        host[2, n:] = -1
        host[3, n:] = 1
        tables = torch.tensor(padded_block_tables(meta.decodes, bsz), dtype=torch.int32)
        width = tables.shape[1]
        self._inputs[:, :bs].copy_(host, non_blocking=True)
        self._tables[:n, :width].copy_(tables, non_blocking=True)
        self._replay(bs)
        return self._outputs[bs][:n]

    def _replay(self, bs: int) -> None:
        self._graphs[bs].replay()
