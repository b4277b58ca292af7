"""The KV tensor pool: the memory the cache's block ids index.

It allocates, per layer, the tensors its spec's storage format names (kv/quant.py: K and V, and
for int8/int4 their scales; one latent for MLA), each [num_blocks, ...per block], and moves whole
blocks: reads (saves to the storage tiers), writes (loads from them) and copies (copy-on-write; a
backend with a faster kernel for its device, like the Triton one, copies through that instead).
New tokens go in (`store`) and blocks come back out dequantized (`gather`) through the layer's
codec, so a backend never needs to know the format.

A hybrid model (kv/spec.py's `page_groups`: equal-size groups of layers, one block table each)
gets S tensors per part instead of one per layer: layer l stores into the tensor of its position
in its group, so a block id is one page of one group's S layers and `layers[l]` is shared
(`storage()` lists each tensor once; `layer_group[l]` names the group whose tables l reads). Attention backends compute over these
tensors and own none; the runner executes a step plan's memory operations, in the plan's order,
through this pool and the backend.

A tier chunk of an unquantized or fp8 pool is [layers, tensors, tokens, heads, width] in the
stored dtype; a pool with scale parts (int8, int4) is packed per block, so a chunk is bytes,
[layers, 1, blocks, 1, page_bytes] uint8 (one page = every part of one block of one layer): the
tiers store exactly the quantized bytes and scales.
"""

from __future__ import annotations

import logging

import torch

from kvserve.utils import features as F
from kvserve.utils import hugepages
from kvserve.kv.quant import BlockState, KVScales, make_codecs
from kvserve.kv.spec import KVCacheSpec, KVGroup

logger = logging.getLogger("kvserve")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
           ) -> torch.Tensor:
    """Zeroed, not empty: masked-out slots still take part in the attention matmuls (weight
    0), and 0 x NaN from uninitialised memory would poison the output.

    On the CPU the memory is `hugepages.empty`'s: a private anonymous mapping of its own,
    which the kernel hands out as zero (huge) pages when they are first touched. Why: zeroing the default 4 GiB pool took 2-9 s of every start on a 2-core machine,
    for blocks most runs never use; now only the blocks written are faulted in (the pool's
    RSS grows with use, up to its size)."""
    if torch.device(device).type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    return hugepages.empty(shape, dtype)


class KVTensorPool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu",
                 kv_scales: torch.Tensor | None = None, calculate_kv_scales: bool = False,
                 page_groups: tuple[KVGroup, ...] | None = None) -> None:
        """`kv_scales` [layers, 2] are fp8's per-layer (k_scale, v_scale), from the checkpoint;
        without them `calculate_kv_scales` takes them from the first K/V stored, else 1.0.

        `page_groups` (kv/spec.py's hybrid layout, groups of S layers): a block id is one page
        of one group's layers, so only S tensors per part are allocated and the i-th layer of
        every group stores into the i-th (`layers[l]` is that shared tensor)."""
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self._setup(spec, num_blocks, kv_scales, calculate_kv_scales)

        def allocate(codec) -> tuple[torch.Tensor, ...]:
            return tuple(_zeros((num_blocks, *p.shape), p.dtype, device)
                         for p in codec.parts())

        self.page_groups = page_groups
        self.layer_group: list[int] = [0] * len(self.codecs)
        if page_groups is None:
            self.layers: list[tuple[torch.Tensor, ...]] = [allocate(c) for c in self.codecs]
            self._storage = self.layers
            return
        if self.block_state is not None:  # int4's residual rows are per block of every layer
            F.refuse(F.INT4, F.HYBRID)
        # The i-th layer of every group shares one tensor: S of them, shaped after any group's
        # layers (page_groups makes their shapes and storage equal).
        slots = [allocate(self.codecs[layer]) for layer in page_groups[0].layers]
        self._storage = slots
        self.layers = [slots[0]] * len(self.codecs)
        for g, group in enumerate(page_groups):
            if len(group.layers) != len(slots):
                raise ValueError("page groups must be of equal size")
            for i, layer in enumerate(group.layers):
                self.layers[layer] = slots[i]
                self.layer_group[layer] = g

    def _setup(self, spec: KVCacheSpec, num_blocks: int, kv_scales: torch.Tensor | None,
               calculate_kv_scales: bool) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        specs = spec.layer_specs()
        self.scales: KVScales | None = None
        if any(s.storage.dtype in ("fp8", "fp8_e5m2") for s in specs):
            values = torch.ones(len(specs), 2) if kv_scales is None else \
                kv_scales.detach().float().cpu().clone()
            if tuple(values.shape) != (len(specs), 2):
                raise ValueError(f"kv_scales must be [layers, 2], got {tuple(values.shape)}")
            self.scales = KVScales(values, calculate=kv_scales is None and calculate_kv_scales)
        self.codecs = make_codecs(specs, spec.block_size, self.scales)
        # The codecs' per-block state (int4's residual rows; one shared by every layer), None
        # for every other format: the pool only calls its hooks.
        self.block_state: BlockState | None = next(
            (c.block_state for c in self.codecs if c.block_state is not None), None)
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.quantized = any(c.quantized for c in self.codecs)

    @classmethod
    def wrap(cls, spec: KVCacheSpec, layers: list[tuple[torch.Tensor, ...]]) -> "KVTensorPool":
        """A pool over tensors allocated elsewhere (tests; memory a caller manages), checked
        against the spec's shapes."""
        specs = spec.layer_specs()
        if len(layers) != len(specs):
            raise ValueError(f"{len(layers)} layers of KV tensors for a spec of {len(specs)}")
        num_blocks = layers[0][0].shape[0]
        pool = cls.__new__(cls)
        pool._setup(spec, num_blocks, None, False)
        for tensors, codec in zip(layers, pool.codecs):
            want = [(num_blocks, *p.shape) for p in codec.parts()]
            got = [tuple(t.shape) for t in tensors]
            if got != want:
                raise ValueError(f"KV tensors of shapes {got} do not fit block_size "
                                 f"{spec.block_size} and the spec's {want}")
        pool.layers = list(layers)
        pool._storage = pool.layers
        pool.page_groups = None
        pool.layer_group = [0] * len(layers)
        return pool

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def dtype(self) -> torch.dtype:
        """The element type of the stored K/V data (uint8: fp8 bytes, int8/int4 codes)."""
        return self.layers[0][0].dtype

    @property
    def packed(self) -> bool:
        """Whether a block's parts differ in shape or dtype (scales beside codes), so that tier
        chunks carry it as bytes."""
        parts = self.codecs[0].parts()
        return any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, every part (equal across layers)."""
        return sum(t[0].numel() * t.element_size() for t in self.layers[0])

    def format_tag(self) -> str:
        """What besides shapes makes two pools' chunks incompatible: the storage format and,
        for fp8, the scales (part of a tier chunk's identity); "" for unquantized pools."""
        if not self.quantized:
            return ""
        storage = self.spec.layer_specs()[0].storage
        tag = f"{storage.dtype}:g{storage.group_size}:kg{storage.key_group_tokens}"
        if self.scales is not None:
            if self.scales.calculate:  # only tiers ask for a tag
                F.refuse(F.KV_TIERS, F.CALCULATE_KV_SCALES)
            tag += ":scales=" + ",".join(f"{x:.8g}" for x in self.scales.values.flatten().tolist())
        return tag

    def storage(self) -> list[tuple[torch.Tensor, ...]]:
        """Each allocated tensor tuple once (layers share them under page groups)."""
        return self._storage

    def _whole_blocks(self, feature: str) -> None:
        """Tier chunks and compaction (`feature`: KV_TIERS, BOUNDED) read a block id as every
        layer's block: not so under page groups (the engine turns those off for them)."""
        if self.page_groups is not None:
            F.refuse(F.HYBRID, feature)

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    @property
    def keeps_block_state(self) -> bool:
        """Whether a codec keeps state per block (int4): only then does the engine name the
        freed blocks in each step plan (`release`)."""
        return self.block_state is not None

    # -- a step's K/V ------------------------------------------------------------------------
    def begin_step(self, writes: list[tuple[list[int], int, int]], num_tokens: int):
        """The codecs' plan of what this step's stores do beyond writing slots (None without
        block state): (block table, first position, end) per sequence, in the flat batch's
        order."""
        if self.block_state is None:
            return None
        return self.block_state.begin_step(writes, num_tokens)

    def release(self, blocks: list[int]) -> None:
        """Blocks nobody holds any more: the codecs forget their state (int4's residual rows:
        a finished or preempted request leaves its last, partial block behind)."""
        if self.block_state is not None:
            self.block_state.drop(blocks)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              step=None) -> None:
        """Write new K/V [T, H, D] of `layer` into their slots, quantizing as the format says
        (`step`: `begin_step`'s plan)."""
        self.codecs[layer].store(layer, self.layers[layer], k, v, slots, step)

    def state_lookup(self, blocks: torch.Tensor):
        """Once per step and gather index, after `begin_step`: what of `blocks` the codecs'
        block state serves (int4: keys from the full-precision residual instead of the codes;
        None: nothing), for `gather`."""
        return None if self.block_state is None else self.block_state.lookup(blocks)

    def gather(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype, state_at=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` [n] (int64), dequantized into `dtype`: [n, block_size, H, D]
        each. Only these blocks are read: never a dequantized copy of the whole pool. The
        result lives in two reused buffers (fresh tensors would pay page faults every layer of
        every step): it is valid until the next `gather`."""
        codec = self.codecs[layer]
        shape = (blocks.shape[0], self.block_size, codec.heads, codec.head_dim)
        out = (self._buffer(0, shape, dtype), self._buffer(1, shape, dtype))
        return codec.load(layer, self.layers[layer], blocks, dtype, state_at, out)

    def _buffer(self, which: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        buf = self._buffers.get((which, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[(which, dtype)] = buf
        return buf[:numel].view(shape)

    # -- whole blocks ------------------------------------------------------------------------
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for tensors in self.storage():
            for t in tensors:
                t[d] = t[s]
        if self.block_state is not None:
            for a, b in zip(src, dst):
                self.block_state.copy(a, b)

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """The KV of whole blocks, every layer, as one contiguous host tensor
        [layers, tensors per layer, len(blocks) * block_size, heads, width] (what a tier saves),
        or for a packed pool [layers, 1, len(blocks), 1, page_bytes] uint8."""
        self._whole_blocks(F.KV_TIERS)
        idx = self._index(blocks)
        if self.packed:
            n = len(blocks)
            pages = [torch.cat([t.index_select(0, idx).reshape(n, -1).view(torch.uint8)
                                for t in tensors], 1) for tensors in self.layers]
            return torch.stack(pages)[:, None, :, None, :].cpu()
        out = torch.stack([torch.stack([t.index_select(0, idx) for t in tensors])
                           for tensors in self.layers])
        return out.flatten(2, 3).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Put KV read by `read_blocks` (same shape) back into the given blocks (a tier load)."""
        self._whole_blocks(F.KV_TIERS)
        idx = self._index(blocks)
        if self.block_state is not None:
            self.block_state.drop(blocks)
        if self.packed:
            pages = data.to(self.device)[:, 0, :, 0, :]  # [layers, n, page_bytes]
            for layer, tensors in enumerate(self.layers):
                at = 0
                for t in tensors:
                    size = t[0].numel() * t.element_size()
                    part = pages[layer, :, at:at + size].contiguous().view(t.dtype)
                    t.index_copy_(0, idx, part.view(len(blocks), *t.shape[1:]))
                    at += size
            return
        data = data.to(device=self.device, dtype=self.dtype, non_blocking=True)
        data = data.unflatten(2, (len(blocks), self.block_size))
        for layer, tensors in enumerate(self.layers):
            for j, t in enumerate(tensors):
                t.index_copy_(0, idx, data[layer, j])

    def block_differences(self, pairs: list[tuple[int, int]], chunk: int = 64
                          ) -> list[tuple[float, float]]:
        """How far the KV of each (reference, other) pair of blocks is apart (a KV audit,
        kvserve/engine/audit.py): per pair, the largest absolute difference over the
        reference's largest magnitude and the mean one over its mean magnitude, each the worst
        of every layer and stored tensor (so one layer's scale cannot hide another's error);
        inf where either block holds a non-finite value (garbage bytes decode to NaN). A
        quantized format is compared dequantized, as attention reads it; under page groups a
        block id is one page of every slot tensor, so the comparison is the same. `chunk`
        pairs at a time, in fp32 temporaries (not the gather buffers, which stay as small as
        attention needs them)."""
        out: list[tuple[float, float]] = []
        for at in range(0, len(pairs), chunk):
            part = pairs[at:at + chunk]
            n = len(part)
            idx = self._index([a for a, _ in part] + [b for _, b in part])
            worst = torch.zeros(2, n, device=self.device)
            for both in self._dequantized(idx):
                both = both.float().flatten(1)
                ref, other = both[:n], both[n:]
                diff = (ref - other).abs()
                scale = ref.abs()
                ratios = torch.stack([diff.amax(1) / scale.amax(1).clamp_min(1e-12),
                                      diff.mean(1) / scale.mean(1).clamp_min(1e-12)])
                finite = torch.isfinite(both).all(1)
                ratios[:, ~(finite[:n] & finite[n:])] = float("inf")
                worst = torch.maximum(worst, ratios)
            out.extend(zip(*worst.cpu().tolist()))
        return out

    def _dequantized(self, idx: torch.Tensor):
        """Each stored tensor of the blocks `idx` in turn, as attention reads it."""
        if not self.quantized:
            for tensors in self.storage():
                yield from (t.index_select(0, idx) for t in tensors)
            return
        for layer, codec in enumerate(self.codecs):
            shape = (idx.shape[0], self.block_size, codec.heads, codec.head_dim)
            yield from codec.load(layer, self.layers[layer], idx, torch.float32, None, tuple(
                torch.empty(shape, dtype=torch.float32, device=self.device) for _ in "kv"))

    def compact_tokens(self, src_table: list[int], keep: torch.Tensor, dst_table: list[int]
                       ) -> None:
        """Copy the kept tokens of a sequence, every layer, from its blocks `src_table` into
        the first `keep.shape[-1]` slots of `dst_table` (a bounded cache's compaction,
        kvserve.kv.bounded). `keep` holds token indices into the source sequence: [n], the same
        tokens for every head; [heads, n], each KV head its own (head h's slot j then holds a
        different token than head h' 's: attention is per head, so they never mix); or
        [layers, heads, n]. The two tables must not share a block."""
        self._whole_blocks(F.BOUNDED)
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
