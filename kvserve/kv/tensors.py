"""The KV tensor pool: the memory the cache's block ids index.

It allocates, per layer, the tensors its spec names (K and V for attention, one latent for MLA),
each [num_blocks, block_size, heads, width], and moves whole blocks: reads (saves to the storage
tiers), writes (loads from them) and copies (copy-on-write; a backend with a faster kernel for
its device, like the Triton one, copies through that instead). Attention backends compute over
these tensors and own none; the runner executes a step plan's memory operations, in the plan's
order, through this pool and the backend.
"""

from __future__ import annotations

import torch

from kvserve.kv.spec import KVCacheSpec


class KVTensorPool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu"
                 ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        # Zeroed, not empty: masked-out slots still take part in the attention matmuls (weight
        # 0), and 0 x NaN from uninitialised memory would poison the output.
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((num_blocks, spec.block_size, heads, width),
                              dtype=layer.storage.torch_dtype, device=device)
                  for heads, width in layer.tensors)
            for layer in spec.layer_specs()]

    @classmethod
    def wrap(cls, spec: KVCacheSpec, layers: list[tuple[torch.Tensor, ...]]) -> "KVTensorPool":
        """A pool over tensors allocated elsewhere (tests; memory a caller manages), checked
        against the spec's shapes."""
        specs = spec.layer_specs()
        if len(layers) != len(specs):
            raise ValueError(f"{len(layers)} layers of KV tensors for a spec of {len(specs)}")
        num_blocks = layers[0][0].shape[0]
        for tensors, layer in zip(layers, specs):
            want = [(num_blocks, spec.block_size, h, w) for h, w in layer.tensors]
            got = [tuple(t.shape) for t in tensors]
            if got != want:
                raise ValueError(f"KV tensors of shapes {got} do not fit block_size "
                                 f"{spec.block_size} and the spec's {want}")
        pool = cls.__new__(cls)
        pool.spec, pool.num_blocks, pool.block_size = spec, num_blocks, spec.block_size
        pool.layers = list(layers)
        return pool

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][0].dtype

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for tensors in self.layers:
            for t in tensors:
                t[d] = t[s]

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """The KV of whole blocks, every layer, as one contiguous host tensor
        [layers, tensors per layer, len(blocks) * block_size, heads, width] (what a tier saves)."""
        idx = self._index(blocks)
        out = torch.stack([torch.stack([t.index_select(0, idx) for t in tensors])
                           for tensors in self.layers])
        return out.flatten(2, 3).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Put KV read by `read_blocks` (same shape) back into the given blocks (a tier load)."""
        idx = self._index(blocks)
        data = data.to(device=self.device, dtype=self.dtype, non_blocking=True)
        data = data.unflatten(2, (len(blocks), self.block_size))
        for layer, tensors in enumerate(self.layers):
            for j, t in enumerate(tensors):
                t.index_copy_(0, idx, data[layer, j])

    def compact_tokens(self, src_table: list[int], keep: torch.Tensor, dst_table: list[int]
                       ) -> None:
        """Copy the kept tokens of a sequence, every layer, from its blocks `src_table` into
        the first `keep.shape[-1]` slots of `dst_table` (a bounded cache's compaction,
        kvserve.kv.bounded). `keep` holds token indices into the source sequence: [n], the same
        tokens for every head; [heads, n], each KV head its own (head h's slot j then holds a
        different token than head h' 's: attention is per head, so they never mix); or
        [layers, heads, n]. The two tables must not share a block."""
        bs = self.block_size
        src = torch.tensor(src_table, dtype=torch.long)
        n = keep.shape[-1]
        dst = torch.tensor(dst_table, dtype=torch.long)
        j = torch.arange(n)
        dst_slots = (dst[j // bs] * bs + j % bs).to(self.device)
        keep = keep.long()
        for layer, tensors in enumerate(self.layers):
            for t in tensors:
                heads = t.shape[2]
                idx = keep.expand(heads, n) if keep.dim() == 1 else \
                    keep if keep.dim() == 2 else keep[layer]
                src_slots = (src[idx // bs] * bs + idx % bs).to(self.device)  # [heads, n]
                flat = t.view(-1, heads, t.shape[3])
                rows = flat[src_slots, torch.arange(heads, device=self.device)[:, None]]
                flat[dst_slots] = rows.transpose(0, 1)
