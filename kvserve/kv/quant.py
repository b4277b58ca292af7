"""Quantized KV storage: how each format lays a block out in the pool, and how K/V go in and
come back out.

One `KVCodec` per storage format (kv/spec.py's `KVStorage`) is the single place that knows it:
the tensor pool allocates the parts it names, stores new tokens and gathers blocks through it,
and the attention backends read through it. Per layer and per block the parts are:

| format            | parts (per block)                                                         |
|-------------------|---------------------------------------------------------------------------|
| fp32 / fp16 / bf16| k, v [bs, H, D] in that dtype                                             |
| fp8 (e4m3), e5m2  | k, v [bs, H, D] float8; one scale per layer for K and one for V           |
|                   | (`KVScales`, not per block: vLLM's per-tensor scales)                     |
| int8              | k, v [bs, H, D] uint8; k_sz, v_sz [bs, H, G, 2] fp16 (scale, zero point)  |
|                   | per token, per head, per group of D/G channels                            |
| int4 (KIVI)       | k, v [bs, H, D/2] uint8, two codes per byte (low nibble = even channel);  |
|                   | k_sz [H, D, 2] fp16: keys per channel over the block's tokens;            |
|                   | v_sz [bs, H, G, 2] fp16: values per token like int8                       |

Integer codes are affine: x ~= code * scale + zero, with scale = (max - min) / (2^bits - 1) and
zero = min of the group, both kept in fp16 (the spec's 4 bytes per group). Quantizing uses the
fp16-rounded scale and zero, so decoding returns the nearest code's value exactly.

int4 keys need a whole block of tokens before their per-channel scales exist, so (as KIVI's
full-precision residual) the keys of a block that is still filling live in a `KIVIResidual` row
in the model's dtype; when the block's last slot is written its keys are quantized once, as a
group, and the row is let go. Decode therefore never re-quantizes an old group. A block that
starts filling from a copy (copy-on-write of a partly matched block) takes its row from the
copy's dequantized keys, so those tokens are quantized twice (once in the source block).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvserve.kv.spec import FullAttentionSpec, KVStorage, LayerSpec

logger = logging.getLogger("kvserve")

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# `calculate_kv_scales`: scale = amax of the first batch x this / the format's max, so later
# tokens up to twice as large still fit (fp8's precision is relative: the headroom costs only
# the subnormal range).
CALIBRATION_HEADROOM = 2.0


# Where a gather's int4 keys come from the residual: (positions in the gather, residual rows).
ResidualAt = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class Part:
    """One tensor of a layer's pool: its shape per block and its element type."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# -- the arithmetic, on plain tensors -------------------------------------------------------
def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in a float8 dtype, saturated at its largest finite value (a plain cast would
    give NaN or inf)."""
    limit = FP8_MAX[dtype]
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-limit, limit).to(dtype)


def quantize_affine(x: torch.Tensor, bits: int, groups: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric integer codes of `x` along its last dimension, split into `groups` equal
    groups: (codes uint8 of x's shape, sz fp16 [..., groups, 2] = (scale, zero))."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], groups, shape[-1] // groups)
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).half()
    zero = lo.half()
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = ((g - zero.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes.reshape(shape), torch.cat([scale, zero], -1)


def dequantize_affine_into(out: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> None:
    """The inverse of `quantize_affine` (code * scale + zero) written into `out` (float, codes'
    shape): one multiply that reads the codes and writes out, one add; no full-size
    temporaries (a decode step's gather is large)."""
    groups = sz.shape[-2]
    width = codes.shape[-1]
    o = out.view(*out.shape[:-1], groups, width // groups)
    c = codes.view(*codes.shape[:-1], groups, width // groups)
    torch.mul(c, sz[..., 0:1].to(out.dtype), out=o)
    o.add_(sz[..., 1:2].to(out.dtype))


def dequantize_int4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         zero: torch.Tensor) -> None:
    """Unpack and dequantize in one multiply per nibble: out [..., G, W/G] float, packed
    [..., G, W/(2G)] bytes, scale and zero broadcastable to out (even and odd channels are
    the low and high nibbles)."""
    o = out.view(*out.shape[:-1], out.shape[-1] // 2, 2)
    per_channel = scale.shape[-1] != 1
    torch.mul(packed & 0x0F, scale[..., 0::2] if per_channel else scale, out=o[..., 0])
    torch.mul(packed >> 4, scale[..., 1::2] if per_channel else scale, out=o[..., 1])
    out.add_(zero)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., W] codes in 0..15 -> [..., W/2] bytes: channel 2i in the low nibble, 2i+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], -1).flatten(-2)


# -- scales of the fp8 formats --------------------------------------------------------------
@dataclass
class KVScales:
    """fp8's per-layer K and V scales (vLLM's k_scale / v_scale): stored = x / scale.

    From the checkpoint when it has them; else, with `calculate`, from the amax of the first
    K/V each layer stores (then fixed); else 1.0, which the engine warns about."""

    values: torch.Tensor  # [layers, 2] float32 on the host: (k_scale, v_scale)
    calculate: bool = False
    calibrated: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.calibrated:
            self.calibrated = [not self.calculate] * self.values.shape[0]
        # Python floats for `get`, read per layer per step by every fp8 store and load: kept
        # beside `values` (written only by `observe`) instead of two tensor reads each call.
        self._floats = [tuple(row) for row in self.values.tolist()]

    def get(self, layer: int) -> tuple[float, float]:
        return self._floats[layer]

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor, limit: float) -> None:
        """Fix this layer's scales from the first K/V it stores (calculate_kv_scales)."""
        if self.calibrated[layer] or k.numel() == 0:
            return
        for j, x in enumerate((k, v)):
            amax = float(x.detach().abs().max())
            self.values[layer, j] = max(amax * CALIBRATION_HEADROOM / limit, 1e-8)
        self._floats[layer] = tuple(self.values[layer].tolist())
        self.calibrated[layer] = True


# -- the int4 keys' full-precision residual -------------------------------------------------
@dataclass
class KeyTile:
    """One block whose keys this step writes (int4): where its earlier keys come from, and where
    the finished tile goes."""

    block: int
    base_row: int  # residual row holding its earlier keys, or -1
    base_dequant: bool  # earlier keys come from the block's stored codes (a copied block)
    complete: bool  # the block's last slot is written: quantize the tile into the block
    dest_row: int  # residual row that keeps the tile (incomplete), else -1


@dataclass
class KIVIStep:
    """What one step does to int4 keys, decided once for every layer (`KIVIResidual.plan`)."""

    tiles: list[KeyTile]
    tile_of_token: torch.Tensor  # [T] tile index of each new token (-1: not stored / direct)
    offset_of_token: torch.Tensor  # [T] its offset in the block
    # Tokens appended to a row that already holds their block's earlier keys and stays open
    # (a decode's usual case): written straight into the row, slot row * block_size + offset,
    # without a tile.
    direct_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    direct_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


class BlockState(Protocol):
    """State a codec keeps per block beside the pool's tensors (int4: `KIVIResidual`'s rows),
    and the hooks the pool calls on it; a codec without any has `block_state = None`, and then
    the engine hands the worker no freed blocks at all (kv/plan.py's `released`)."""

    def begin_step(self, writes: list[tuple[list[int], int, int]], num_tokens: int) -> Any:
        """Plan the step's stores beyond their slots: (block table, first position, end) per
        sequence, in the flat batch's order; the result goes to every layer's `store`."""

    def lookup(self, blocks: torch.Tensor) -> ResidualAt:
        """After `begin_step`, for a gather index: what of `blocks` the state serves (the
        codec's `load` takes it)."""

    def copy(self, src: int, dst: int) -> None:
        """Block `dst` became a copy of `src`."""

    def drop(self, blocks: Iterable[int]) -> None:
        """Blocks freed, or overwritten whole: forget their state."""


class KIVIResidual:
    """Rows of full-precision keys, one per int4 block that is still filling (the int4 codecs'
    `BlockState`, one shared by every layer's codec).

    `rows` maps a block id to its row; a row is taken when a block starts filling and given back
    the step after its block is quantized, or when the block is freed (`drop`), overwritten by
    a tier load or a copy. Rows grow on demand: a step needs at most one per running sequence."""

    def __init__(self, num_layers: int, block_size: int, heads: int, head_dim: int) -> None:
        self.num_layers, self.block_size = num_layers, block_size
        self.heads, self.head_dim = heads, head_dim
        self.rows: dict[int, int] = {}
        self._free: list[int] = []
        self._release_next: list[int] = []
        self.tensors: list[torch.Tensor] = []  # per layer [capacity, bs, H, D]
        self.capacity = 0
        self._lut: torch.Tensor | None = None  # block id -> row (-1), rebuilt when rows change

    def _take(self) -> int:
        if not self._free:
            old = self.capacity
            self.capacity = max(8, 2 * old)
            self._free = list(range(self.capacity - 1, old - 1, -1))
        return self._free.pop()

    def ensure_storage(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate or enlarge the per-layer row tensors to `capacity` rows."""
        shape = (self.block_size, self.heads, self.head_dim)
        if not self.tensors:
            self.tensors = [torch.zeros((self.capacity, *shape), dtype=dtype, device=device)
                            for _ in range(self.num_layers)]
        elif self.tensors[0].shape[0] < self.capacity:
            extra = self.capacity - self.tensors[0].shape[0]
            self.tensors = [torch.cat([t, t.new_zeros((extra, *shape))]) for t in self.tensors]

    def copy(self, src: int, dst: int) -> None:
        """Block `dst` is a copy of `src`: it gets a copy of src's row, if src has one."""
        self.drop([dst])
        self._lut = None
        row = self.rows.get(src)
        if row is None or not self.tensors:
            return
        new = self._take()
        self.ensure_storage(self.tensors[0].dtype, self.tensors[0].device)
        for t in self.tensors:
            t[new] = t[row]
        self.rows[dst] = new

    def drop(self, blocks) -> None:
        """Blocks freed or overwritten whole: their rows are free again."""
        for b in blocks:
            row = self.rows.pop(b, None)
            if row is not None:
                self._free.append(row)
                self._lut = None

    def begin_step(self, writes: list[tuple[list[int], int, int]], slot_count: int
                   ) -> KIVIStep:
        """Decide rows for this step's writes: (block table, first position, end) per sequence,
        in the order of the step's flat tokens."""
        self._free.extend(self._release_next)
        self._release_next = []
        self._lut = None
        bs = self.block_size
        tiles: list[KeyTile] = []
        tile_of_token: list[int] = []
        offset_of_token: list[int] = []
        direct_tokens: list[int] = []
        direct_slots: list[int] = []
        for table, start, end in writes:
            for j in range(start // bs, (end - 1) // bs + 1):
                lo, hi = max(start, j * bs) - j * bs, min(end, (j + 1) * bs) - j * bs
                block = table[j]
                row = self.rows.pop(block, None)
                base_row = row if (row is not None and lo > 0) else -1
                complete = hi == bs
                if complete:
                    dest = -1
                    if row is not None:
                        self._release_next.append(row)  # read in this step, reused after
                else:
                    dest = row if row is not None else self._take()
                    self.rows[block] = dest
                if base_row >= 0 and base_row == dest:  # an open row continues: no tile
                    direct_tokens += range(len(tile_of_token), len(tile_of_token) + hi - lo)
                    direct_slots += range(dest * bs + lo, dest * bs + hi)
                    tile_of_token += [-1] * (hi - lo)
                else:
                    tile_of_token += [len(tiles)] * (hi - lo)
                    tiles.append(KeyTile(block, base_row, lo > 0 and row is None, complete, dest))
                offset_of_token += range(lo, hi)
        pad = slot_count - len(tile_of_token)  # rows that store nothing (none in the engine)
        return KIVIStep(tiles, torch.tensor(tile_of_token + [-1] * pad, dtype=torch.long),
                        torch.tensor(offset_of_token + [0] * pad, dtype=torch.long),
                        torch.tensor(direct_tokens, dtype=torch.long),
                        torch.tensor(direct_slots, dtype=torch.long))

    def lookup(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions in `blocks` [n] int64, their rows) of the blocks whose keys are in a row
        (after this step's `plan`), or None. Computed once per step for a gather index, from a
        block -> row table built once per change of `rows` (a step's several windows and its
        decode tables share it)."""
        if not self.rows or blocks.numel() == 0:
            return None
        if self._lut is None:
            keys = torch.tensor(list(self.rows), dtype=torch.long)
            self._lut = torch.full((int(keys.max()) + 1,), -1, dtype=torch.long)
            self._lut[keys] = torch.tensor(list(self.rows.values()), dtype=torch.long)
        lut = self._lut
        blocks = blocks.cpu()
        inside = (blocks >= 0) & (blocks < lut.shape[0])
        rows = torch.where(inside, lut[blocks.clamp(0, lut.shape[0] - 1)], -1)
        pos = (rows >= 0).nonzero().flatten()
        if pos.numel() == 0:
            return None
        return pos, rows[pos]


# -- codecs ---------------------------------------------------------------------------------
class KVCodec:
    """Unquantized storage: K and V as they are. Subclasses quantize."""

    quantized = False
    block_state: BlockState | None = None  # per-block state beside the pool's tensors

    def __init__(self, layer: LayerSpec, block_size: int) -> None:
        self.storage: KVStorage = layer.storage
        self.block_size = block_size
        self.shapes = layer.tensors  # (heads, width) per stored tensor: K, V (or one latent)
        self.heads, self.head_dim = self.shapes[0]
        self.dtype = self.storage.torch_dtype

    def parts(self) -> tuple[Part, ...]:
        names = ("k", "v") if len(self.shapes) == 2 else tuple(f"t{i}" for i in
                                                               range(len(self.shapes)))
        return tuple(Part(n, (self.block_size, h, w), self.dtype)
                     for n, (h, w) in zip(names, self.shapes))

    def store(self, layer: int, parts: tuple[torch.Tensor, ...], k: torch.Tensor,
              v: torch.Tensor, slots: torch.Tensor, step: KIVIStep | None) -> None:
        """Write the step's new K/V [T, H, D] into their slots."""
        h, d = self.heads, self.head_dim
        parts[0].view(-1, h, d).index_copy_(0, slots, k.to(self.dtype))
        parts[1].view(-1, h, d).index_copy_(0, slots, v.to(self.dtype))

    def load(self, layer: int, parts: tuple[torch.Tensor, ...], blocks: torch.Tensor,
             dtype: torch.dtype, residual_at: ResidualAt,
             out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks`, [len(blocks), bs, H, D] each, in `dtype`, written into `out`
        (two buffers of that shape and dtype; the pool's reused gather buffers).
        `residual_at` (int4): `KIVIResidual.lookup` of the same blocks."""
        for part, buf in zip(parts, out):
            buf.copy_(part.index_select(0, blocks))
        return out


class FP8Codec(KVCodec):
    """fp8 with a per-layer scale for K and one for V. The pool holds the float8 bytes as uint8
    (PyTorch's CPU index_copy/index_select do not take float8), viewed back to read them."""

    quantized = True

    def __init__(self, layer: FullAttentionSpec, block_size: int, scales: KVScales) -> None:
        super().__init__(layer, block_size)
        self.scales = scales
        self.fp8 = self.dtype
        self.limit = FP8_MAX[self.fp8]
        self.dtype = torch.uint8

    def store(self, layer, parts, k, v, slots, step) -> None:
        self.scales.observe(layer, k, v, self.limit)
        ks, vs = self.scales.get(layer)
        h, d = self.heads, self.head_dim
        for part, x, scale in ((parts[0], k, ks), (parts[1], v, vs)):
            part.view(-1, h, d).index_copy_(0, slots,
                                            quantize_fp8(x, scale, self.fp8).view(torch.uint8))

    def load(self, layer, parts, blocks, dtype, residual_at, out):
        ks, vs = self.scales.get(layer)
        for part, buf, scale in zip(parts, out, (ks, vs)):
            buf.copy_(part.index_select(0, blocks).view(self.fp8))  # the cast is the decode
            if scale != 1.0:
                buf.mul_(scale)
        return out


class Int8Codec(KVCodec):
    """Per token, per head (per group of channels) affine int8."""

    quantized = True
    bits = 8

    def __init__(self, layer: FullAttentionSpec, block_size: int) -> None:
        super().__init__(layer, block_size)
        if self.head_dim % self.storage.groups(self.head_dim):
            raise ValueError(f"group_size must divide head_dim {self.head_dim}")
        self.groups = self.storage.groups(self.head_dim)

    def parts(self) -> tuple[Part, ...]:
        bs, h, d, g = self.block_size, self.heads, self.head_dim, self.groups
        return (Part("k", (bs, h, d), torch.uint8), Part("v", (bs, h, d), torch.uint8),
                Part("k_sz", (bs, h, g, 2), torch.float16),
                Part("v_sz", (bs, h, g, 2), torch.float16))

    def _store_tokens(self, data: torch.Tensor, sz: torch.Tensor, x: torch.Tensor,
                      slots: torch.Tensor) -> None:
        codes, scales = quantize_affine(x, self.bits, self.groups)
        if self.bits == 4:
            codes = pack_int4(codes)
        data.view(-1, self.heads, data.shape[-1]).index_copy_(0, slots, codes)
        sz.view(-1, self.heads, self.groups, 2).index_copy_(0, slots, scales)

    def _load_tokens(self, data: torch.Tensor, sz: torch.Tensor, blocks: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
        codes = data.index_select(0, blocks)
        scales = sz.index_select(0, blocks)
        if self.bits == 8:
            dequantize_affine_into(out, codes, scales)
            return out
        g = self.groups
        grouped = out.view(*out.shape[:-1], g, self.head_dim // g)
        dequantize_int4_into(grouped, codes.view(*codes.shape[:-1], g, -1),
                             scales[..., 0:1].to(out.dtype), scales[..., 1:2].to(out.dtype))
        return out

    def store(self, layer, parts, k, v, slots, step) -> None:
        self._store_tokens(parts[0], parts[2], k, slots)
        self._store_tokens(parts[1], parts[3], v, slots)

    def load(self, layer, parts, blocks, dtype, residual_at, out):
        return (self._load_tokens(parts[0], parts[2], blocks, out[0]),
                self._load_tokens(parts[1], parts[3], blocks, out[1]))


class Int4KIVICodec(Int8Codec):
    """int4 after KIVI: values per token (as int8, 4 bits, packed), keys per channel over the
    tokens of a block, with the filling block's keys in a full-precision residual row."""

    bits = 4

    def __init__(self, layer: FullAttentionSpec, block_size: int,
                 residual: KIVIResidual) -> None:
        super().__init__(layer, block_size)
        if self.head_dim % 2:
            raise ValueError(f"int4 KV packs two channels per byte: head_dim {self.head_dim} "
                             "is odd")
        if (self.storage.key_group_tokens or block_size) != block_size:
            raise ValueError(f"int4 keys are grouped by block: key_group_tokens "
                             f"{self.storage.key_group_tokens} != block_size {block_size}")
        self.residual = residual
        self.block_state = residual  # the pool's hooks reach the rows through this

    def parts(self) -> tuple[Part, ...]:
        bs, h, d, g = self.block_size, self.heads, self.head_dim, self.groups
        return (Part("k", (bs, h, d // 2), torch.uint8), Part("v", (bs, h, d // 2), torch.uint8),
                Part("k_sz", (h, d, 2), torch.float16),
                Part("v_sz", (bs, h, g, 2), torch.float16))

    def quantize_keys(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, bs, H, D] full blocks of keys -> packed codes [n, bs, H, D/2], sz [n, H, D, 2]:
        one scale and zero per channel over the block's tokens."""
        codes, sz = quantize_affine(tiles.permute(0, 2, 3, 1), 4, 1)  # [n, H, D, bs]
        return pack_int4(codes.permute(0, 3, 1, 2)), sz[..., 0, :].contiguous()

    def dequantize_keys(self, packed: torch.Tensor, sz: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_int4(packed).to(dtype)  # [n, bs, H, D]
        s = sz.to(dtype)  # [n, H, D, 2]
        return torch.addcmul(s[..., 1].unsqueeze(1), codes, s[..., 0].unsqueeze(1))

    def store(self, layer, parts, k, v, slots, step) -> None:
        self._store_tokens(parts[1], parts[3], v, slots)
        if step is None:
            raise ValueError("int4 keys need the step's residual plan (KVTensorPool.begin_step)")
        self._store_keys(layer, parts, k, step)

    def _store_keys(self, layer: int, parts, k: torch.Tensor, step: KIVIStep) -> None:
        res = self.residual
        if step.direct_tokens.numel():
            rows = res.tensors[layer]  # exists: these rows held keys before this step
            rows.view(-1, self.heads, self.head_dim).index_copy_(
                0, step.direct_slots.to(k.device), k.index_select(0, step.direct_tokens.to(
                    k.device)).to(rows.dtype))
        if not step.tiles:
            return
        res.ensure_storage(k.dtype, k.device)
        rows = res.tensors[layer]
        n, bs = len(step.tiles), self.block_size
        tiles = torch.zeros((n, bs, self.heads, self.head_dim), dtype=k.dtype, device=k.device)
        from_row = [i for i, t in enumerate(step.tiles) if t.base_row >= 0]
        if from_row:
            src = torch.tensor([step.tiles[i].base_row for i in from_row], dtype=torch.long)
            tiles[torch.tensor(from_row)] = rows.index_select(0, src)
        from_codes = [i for i, t in enumerate(step.tiles) if t.base_dequant]
        if from_codes:
            blocks = torch.tensor([step.tiles[i].block for i in from_codes], dtype=torch.long)
            tiles[torch.tensor(from_codes)] = self.dequantize_keys(
                parts[0].index_select(0, blocks), parts[2].index_select(0, blocks), k.dtype)
        stored = step.tile_of_token >= 0
        tiles[step.tile_of_token[stored], step.offset_of_token[stored]] = k[stored]
        done = [i for i, t in enumerate(step.tiles) if t.complete]
        if done:
            blocks = torch.tensor([step.tiles[i].block for i in done], dtype=torch.long)
            codes, sz = self.quantize_keys(tiles[torch.tensor(done)])
            parts[0].index_copy_(0, blocks, codes)
            parts[2].index_copy_(0, blocks, sz)
        open_ = [i for i, t in enumerate(step.tiles) if not t.complete]
        if open_:
            dest = torch.tensor([step.tiles[i].dest_row for i in open_], dtype=torch.long)
            rows.index_copy_(0, dest, tiles[torch.tensor(open_)])

    def load(self, layer, parts, blocks, dtype, residual_at, out):
        packed, sz = parts[0].index_select(0, blocks), parts[2].index_select(0, blocks)
        kk, vv = out
        sz = sz.to(dtype).unsqueeze(1)  # [n, 1, H, D, 2]: per channel, every token
        dequantize_int4_into(kk, packed, sz[..., 0], sz[..., 1])
        self._load_tokens(parts[1], parts[3], blocks, vv)
        if residual_at is not None:
            pos, rows = residual_at
            kk[pos.to(kk.device)] = self.residual.tensors[layer].index_select(
                0, rows.to(kk.device)).to(dtype)
        return kk, vv


def make_codecs(layers: list[LayerSpec], block_size: int, scales: KVScales | None
                ) -> list[KVCodec]:
    """Every layer's codec; the int4 ones share one `KIVIResidual` (their block state: a row
    per filling block, one tensor per layer)."""
    residual = None
    kivi = [s for s in layers if s.storage.kivi]
    if kivi:
        heads, width = kivi[0].tensors[0]
        residual = KIVIResidual(len(layers), block_size, heads, width)
    return [make_codec(s, block_size, scales, residual) for s in layers]


def make_codec(layer: LayerSpec, block_size: int, scales: KVScales | None,
               residual: KIVIResidual | None) -> KVCodec:
    """The codec of one layer's storage format."""
    storage = layer.storage
    if not storage.format.quantized:
        return KVCodec(layer, block_size)
    if not isinstance(layer, FullAttentionSpec):  # a configuration the engine cannot serve
        why = f"quantized KV ({storage.dtype}) is built for K/V attention layers"
        raise ValueError(f"{why}, not {type(layer).__name__}")  # noqa: TRY004
    if storage.dtype in ("fp8", "fp8_e5m2"):
        assert scales is not None
        return FP8Codec(layer, block_size, scales)
    if storage.dtype == "int8":
        return Int8Codec(layer, block_size)
    if storage.dtype == "int4":
        assert residual is not None
        return Int4KIVICodec(layer, block_size, residual)
    raise ValueError(f"no KV codec for {storage.dtype}")
