"""What each group of layers stores per token, and what that costs in bytes.

One `KVCacheSpec` describes a model's whole KV cache: layer groups, each with one spec (full
attention, a sliding window, or MLA's latent vector) and one storage format (a dtype, and for
grouped integer formats a scale and zero point per group). Everything that sizes KV — the pool's
number of blocks, the start-up capacity line, the tensor pool's shapes, and `kvserve plan` — derives
from these objects, so the engine and the planner cannot disagree about bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.utils.dtypes import short_dtype_name


# -- storage formats ------------------------------------------------------------------------
@dataclass(frozen=True)
class KVDType:
    name: str
    bits: int
    grouped: bool  # an fp16 scale and an fp16 zero point per group of elements
    # The element type of the stored data: the float itself, or uint8 for the integer codes
    # (int4 packs two per byte). kvserve/kv/quant.py holds the layouts that use it.
    torch_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        """Whether reading it back needs a dequantization (anything narrower than 16 bits)."""
        return self.bits < 16


KV_DTYPES = {
    "fp32": KVDType("fp32", 32, False, torch.float32),
    "fp16": KVDType("fp16", 16, False, torch.float16),
    "bf16": KVDType("bf16", 16, False, torch.bfloat16),
    "fp8": KVDType("fp8", 8, False, torch.float8_e4m3fn),  # vLLM's fp8 = fp8_e4m3
    "fp8_e5m2": KVDType("fp8_e5m2", 8, False, torch.float8_e5m2),
    "int8": KVDType("int8", 8, True, torch.uint8),
    "int4": KVDType("int4", 4, True, torch.uint8),
}
# fp8's spellings; the float dtypes' spellings come from kvserve.utils.dtypes (the one alias table).
_FP8_ALIASES = {"fp8_e4m3": "fp8", "fp8_ds_mla": "fp8", "e4m3": "fp8", "e5m2": "fp8_e5m2"}
# The names `--kv-cache-dtype` accepts (vLLM's, plus int8 and int4), for messages and --help.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "bfloat16",
                          "float16", "float32")
SCALE_BYTES_PER_GROUP = 4  # fp16 scale + fp16 zero point
# int4 keys (KIVI) are quantized per channel over this many tokens unless told otherwise: the
# engine's default block size, since the engine makes one block one group.
DEFAULT_KEY_GROUP_TOKENS = 16


def resolve_kv_dtype(name: str, model_dtype: str = "bf16") -> str:
    """vLLM's --kv-cache-dtype names plus int8/int4; "auto" is the model's dtype."""
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        key = model_dtype
    key = short_dtype_name(key) or _FP8_ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(f"KV cache dtype (kv_cache_dtype) must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                         f"got {name!r}")
    return key


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The storage name of an unquantized torch dtype (torch.bfloat16 -> "bf16")."""
    for d in KV_DTYPES.values():
        if d.torch_dtype == dtype:
            return d.name
    raise ValueError(f"no KV storage format for {dtype}")


@dataclass(frozen=True)
class KVStorage:
    """How one stored vector's elements are kept: a dtype and, for int8/int4, a scale and a zero
    point per `group_size` elements (None: one group per vector).

    int4 follows KIVI: values like any grouped vector, keys per channel over groups of
    `key_group_tokens` tokens (the engine uses one block), since keys' outliers sit in fixed
    channels. Such a key costs width/2 bytes plus a scale and zero point per channel shared by
    the group's tokens: 4 x width / key_group_tokens bytes per token."""

    dtype: str = "bf16"
    group_size: int | None = None
    key_group_tokens: int | None = None  # int4 only; None: DEFAULT_KEY_GROUP_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_kv_dtype(self.dtype))
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        if self.key_group_tokens is not None and self.key_group_tokens <= 0:
            raise ValueError(f"key_group_tokens must be positive, got {self.key_group_tokens}")

    @property
    def format(self) -> KVDType:
        return KV_DTYPES[self.dtype]

    @property
    def kivi(self) -> bool:
        """Keys quantized per channel over tokens (int4), not per token like values."""
        return self.dtype == "int4"

    def groups(self, width: int) -> int:
        """Scale groups in one vector of `width` elements (grouped formats)."""
        return math.ceil(width / (self.group_size or width))

    def data_bytes(self, width: int) -> float:
        """Bytes of a vector's elements alone, without scales (the planner's overhead figure)."""
        return width * KV_DTYPES[self.dtype].bits / 8

    def vector_bytes(self, width: int) -> int:
        """Bytes of one stored vector of `width` elements, with its quantization scales."""
        d = KV_DTYPES[self.dtype]
        data_bits = width * d.bits
        if data_bits % 8:
            raise ValueError(f"{width} elements of {d.name} do not fill whole bytes")
        size = data_bits // 8
        if d.grouped:
            size += self.groups(width) * SCALE_BYTES_PER_GROUP
        return size

    def key_vector_bytes(self, width: int) -> int:
        """Bytes per token of one stored key vector: `vector_bytes` except under KIVI, where a
        group of tokens shares one scale and zero point per channel."""
        if not self.kivi:
            return self.vector_bytes(width)
        tokens = self.key_group_tokens or DEFAULT_KEY_GROUP_TOKENS
        scale_bytes = width * SCALE_BYTES_PER_GROUP
        if scale_bytes % tokens:
            raise ValueError(f"int4 keys of {width} channels over groups of {tokens} tokens do "
                             "not take whole bytes per token; use a block size that divides "
                             f"{scale_bytes}")
        return width * KV_DTYPES[self.dtype].bits // 8 + scale_bytes // tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type of the stored data (uint8 codes for int8/int4)."""
        return KV_DTYPES[self.dtype].torch_dtype


# -- what a layer stores per token ----------------------------------------------------------
@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V for every token: num_kv_heads vectors of head_dim each."""

    num_kv_heads: int
    head_dim: int
    storage: KVStorage = KVStorage()

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.storage.key_vector_bytes(self.head_dim)
                                    + self.storage.vector_bytes(self.head_dim))

    @property
    def data_bytes_per_token(self) -> float:
        return 2 * self.num_kv_heads * self.storage.data_bytes(self.head_dim)

    @property
    def tensors(self) -> tuple[tuple[int, int], ...]:
        """The per-token shape of each stored tensor (K, V)."""
        return ((self.num_kv_heads, self.head_dim),) * 2

    def tokens_held(self, seq_len: int) -> int:
        return seq_len


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V like full attention, but attention reads only the last `window` tokens, so a
    sequence needs no more than that many (older blocks can be let go)."""

    window: int = 4096

    def tokens_held(self, seq_len: int) -> int:
        return min(seq_len, self.window)


@dataclass(frozen=True)
class MLALatentSpec:
    """MLA (DeepSeek-V2/V3): one compressed latent of `kv_lora_rank` plus the decoupled RoPE key
    of `rope_dim` per token, shared by every head."""

    kv_lora_rank: int
    rope_dim: int = 0
    storage: KVStorage = KVStorage()

    @property
    def bytes_per_token(self) -> int:
        return self.storage.vector_bytes(self.kv_lora_rank + self.rope_dim)

    @property
    def data_bytes_per_token(self) -> float:
        return self.storage.data_bytes(self.kv_lora_rank + self.rope_dim)

    @property
    def tensors(self) -> tuple[tuple[int, int], ...]:
        return ((1, self.kv_lora_rank + self.rope_dim),)

    def tokens_held(self, seq_len: int) -> int:
        return seq_len


LayerSpec = FullAttentionSpec | SlidingWindowSpec | MLALatentSpec


@dataclass(frozen=True)
class KVGroup:
    """Layers that store the same thing per token."""

    layers: tuple[int, ...]
    spec: LayerSpec


def first_visible(query_pos: int, window: int | None) -> int:
    """The first key position a query at `query_pos` attends to (0 without a window):
    transformers' rule, key k is visible to query q iff q - window < k <= q."""
    return 0 if window is None else max(0, query_pos - window + 1)


def first_needed_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block a sequence that has `num_tokens` tokens before its next query still
    reads: the one holding that query's first visible key. The one home of this rule: the
    manager releases blocks before it, the prefix index needs a hit's blocks from it on, and
    the attention backends gather from it."""
    return first_visible(num_tokens, window) // block_size


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's whole KV cache, per token and per block of `block_size` tokens."""

    groups: tuple[KVGroup, ...]
    block_size: int

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def release_window(self) -> int | None:
        """The window outside which a request's blocks can be released from one block table:
        the largest window when every layer has one (Mistral-style), else None (a hybrid model
        would need a table per group)."""
        if not all(isinstance(g.spec, SlidingWindowSpec) for g in self.groups):
            return None
        return max(g.spec.window for g in self.groups)  # type: ignore[union-attr]

    def page_groups(self) -> tuple[KVGroup, ...] | None:
        """The hybrid layout (vLLM's hybrid allocator): the layers split into groups of equal
        size S (the gcd of the per-spec layer counts), each S layers of one spec, full-attention
        groups first. A block id then names one page of one group's S layers, each group has
        its own block table, and a windowed group releases the blocks before its window while
        a full group keeps them. The i-th layer of every group shares one tensor (same bytes,
        no padding), so the layers' per-token shapes and storage must agree.

        None when one table serves (every layer full, or every layer windowed: Mistral-style,
        `release_window`) or when the layers' shapes differ (every block is then kept)."""
        if len(self.groups) < 2 or self.release_window is not None:
            return None
        shapes = {(g.spec.tensors, g.spec.storage) for g in self.groups}
        if len(shapes) != 1 or any(isinstance(g.spec, MLALatentSpec) or g.spec.storage.kivi
                                   for g in self.groups):
            return None  # int4 keeps per-block residual rows per layer: one table
        size = math.gcd(*(len(g.layers) for g in self.groups))
        ordered = sorted(self.groups, key=lambda g: isinstance(g.spec, SlidingWindowSpec))
        return tuple(KVGroup(g.layers[i:i + size], g.spec) for g in ordered
                     for i in range(0, len(g.layers), size))

    def page_bytes(self, page_groups: tuple[KVGroup, ...] | None) -> int:
        """Bytes one block id stands for: every layer's block, or one group's S layers'."""
        if page_groups is None:
            return self.bytes_per_block
        g = page_groups[0]
        return len(g.layers) * g.spec.bytes_per_token * self.block_size

    def layer_specs(self) -> list[LayerSpec]:
        """Each layer's spec, in layer order."""
        out: list[LayerSpec | None] = [None] * self.num_layers
        for g in self.groups:
            for i in g.layers:
                out[i] = g.spec
        assert all(s is not None for s in out), "layer groups leave a gap"
        return out  # type: ignore[return-value]

    @property
    def bytes_per_token(self) -> int:
        """Every layer, one token (before any sliding-window cap)."""
        return sum(len(g.layers) * g.spec.bytes_per_token for g in self.groups)

    @property
    def data_bytes_per_token(self) -> float:
        """Every layer, one token, the elements alone (no quantization scales)."""
        return sum(len(g.layers) * g.spec.data_bytes_per_token for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def bytes_per_request(self, seq_len: int, whole_blocks: bool = True) -> int:
        """One request of `seq_len` tokens: each layer holds what its spec keeps of them, rounded
        up to whole blocks unless `whole_blocks` is False."""
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        total = 0
        for g in self.groups:
            tokens = g.spec.tokens_held(seq_len)
            if whole_blocks:
                tokens = -(-tokens // self.block_size) * self.block_size
            total += len(g.layers) * tokens * g.spec.bytes_per_token
        return total


def capacity_line(num_blocks: int, block_size: int, max_model_len: int,
                  blocks_per_request: int | None = None, num_groups: int = 1) -> str:
    """vLLM's start-up line: the pool in tokens, and how many max-length requests it holds
    (each `blocks_per_request` blocks when given: a windowed cache holds fewer than
    max_model_len / block_size, the count `kvserve plan` uses too). With `num_groups` per-group
    tables a block is one group's page, so a token of every layer takes one block per group."""
    tokens = num_blocks * block_size // num_groups
    concurrency = tokens / max_model_len if blocks_per_request is None \
        else num_blocks / blocks_per_request
    return (f"KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens "
            f"per request: {concurrency:.2f}x")


def mla_saving_line(spec: MLALatentSpec, num_heads: int, qk_head_dim: int,
                    v_head_dim: int) -> str:
    """What the latent cache saves against the same model's decompressed K/V (every head's
    key of qk_nope + qk_rope and value of v_head): the start-up line beside `capacity_line`."""
    latent = spec.kv_lora_rank + spec.rope_dim
    full = num_heads * (qk_head_dim + v_head_dim)
    return (f"MLA latent cache: {latent:,} values per token per layer vs {full:,} for the "
            f"decompressed K/V ({num_heads} heads x ({qk_head_dim} + {v_head_dim})): "
            f"{full / latent:.1f}x the tokens in the same memory")


def decoder_kv_spec(num_layers: int, num_kv_heads: int, head_dim: int, storage: KVStorage,
                    block_size: int, layer_windows: tuple[int | None, ...] = (),
                    kv_lora_rank: int | None = None, rope_dim: int = 0) -> KVCacheSpec:
    """The spec of a decoder-only model: MLA if it has a latent rank, else (per layer) full
    attention or a sliding window; layers with equal specs form one group."""
    windows = layer_windows or (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    specs: list[LayerSpec] = []
    for w in windows:
        if kv_lora_rank:
            specs.append(MLALatentSpec(kv_lora_rank, rope_dim, storage))
        elif w is None:
            specs.append(FullAttentionSpec(num_kv_heads, head_dim, storage))
        else:
            specs.append(SlidingWindowSpec(num_kv_heads, head_dim, storage, w))
    by_spec: dict[LayerSpec, list[int]] = {}
    for i, s in enumerate(specs):
        by_spec.setdefault(s, []).append(i)
    return KVCacheSpec(tuple(KVGroup(tuple(ls), s) for s, ls in by_spec.items()), block_size)
