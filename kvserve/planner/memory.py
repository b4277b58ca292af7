"""KV-cache and weight memory: the formulas, one function each.

KV bytes per token, standard attention (MHA, GQA, MQA), per layer:

    2 (K and V) x kv_heads x head_dim x dtype_bytes

and MLA (DeepSeek-V2/V3), per layer: one latent of (kv_lora_rank + qk_rope_head_dim) x dtype_bytes,
with no separate V. A request of L tokens holds, on a layer with a sliding window W, min(L, W)
tokens; on a full-attention layer all L. Quantized KV layouts (int8, int4) store one fp16 scale and
one fp16 zero point per group of elements (by default a group is one head's vector of one token,
K and V separately); fp8 uses per-tensor scales, a few bytes per layer, nothing per token.

Tensor parallelism splits KV heads across GPUs (a GPU holds kv_heads / tp of them, or one
replicated head when tp > kv_heads); the MLA latent is not split: every GPU holds it whole.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.utils.dtypes import short_dtype_name
from kvserve.kv.spec import (KV_DTYPES, KVCacheSpec, KVStorage, MLALatentSpec, decoder_kv_spec,
                             mla_saving_line)
from kvserve.kv.spec import resolve_kv_dtype as _resolve_kv_dtype
from kvserve.model_loader.tp_layout import split
from kvserve.planner.model import ModelSpec

# -- KV bytes: from the same spec classes the engine sizes its pool with ----------------------


def resolve_kv_dtype(name: str, spec: ModelSpec | None = None) -> str:
    """vLLM's --kv-cache-dtype names plus int8/int4; "auto" is the model's dtype."""
    return _resolve_kv_dtype(name, spec.dtype if spec is not None else "bf16")


def kv_heads_per_gpu(spec: ModelSpec, tp: int = 1) -> int:
    """The KV heads of the largest rank, which sizes every rank's pool (the engine's split,
    kvserve/model_loader/tp_layout.py: near-equal ranges, so 3 heads over 2 ranks are 2 + 1; with
    fewer heads than ranks each rank holds a replica of one)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if spec.attention == "mla":
        return 1
    if tp > spec.num_kv_heads:
        if tp % spec.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the "
                             f"{spec.num_kv_heads} KV heads")
        return 1  # each GPU holds a replica of one KV head
    start, stop = split(spec.num_kv_heads, tp, 0)  # rank 0's part is the largest
    return stop - start


def kv_cache_spec(spec: ModelSpec, dtype: str, tp: int = 1, group_size: int | None = None,
                  block_size: int = 1, key_group_tokens: int | None = None) -> KVCacheSpec:
    """What one GPU stores per token for this model: the engine's spec objects (kvserve.kv.spec),
    so the planner and the engine cannot disagree. `key_group_tokens` is int4's (KIVI) key
    group; the engine makes it the block size."""
    storage = KVStorage(resolve_kv_dtype(dtype, spec), group_size, key_group_tokens)
    return decoder_kv_spec(spec.num_layers, kv_heads_per_gpu(spec, tp), spec.head_dim, storage,
                           block_size, spec.layer_windows, spec.kv_lora_rank,
                           spec.qk_rope_head_dim)


def _mla_saving(spec: ModelSpec) -> str | None:
    """The engine's start-up line on what MLA saves, for an MLA model."""
    m = spec.mla
    if m is None:
        return None
    return mla_saving_line(MLALatentSpec(m.kv_lora_rank, m.qk_rope_head_dim),
                           spec.num_attention_heads, m.qk_head_dim, m.v_head_dim)


def kv_bytes_per_token_layer(spec: ModelSpec, dtype: str, tp: int = 1,
                             group_size: int | None = None,
                             key_group_tokens: int | None = None) -> int:
    """One layer, one token, on one GPU."""
    return kv_cache_spec(spec, dtype, tp, group_size,
                         key_group_tokens=key_group_tokens).groups[0].spec.bytes_per_token


def kv_bytes_per_token(spec: ModelSpec, dtype: str, tp: int = 1,
                       group_size: int | None = None, key_group_tokens: int | None = None) -> int:
    """All layers, one token, on one GPU, before any sliding-window cap."""
    return kv_cache_spec(spec, dtype, tp, group_size,
                         key_group_tokens=key_group_tokens).bytes_per_token


def kv_bytes_per_request(spec: ModelSpec, dtype: str, seq_len: int, block_size: int | None = None,
                         tp: int = 1, group_size: int | None = None,
                         key_group_tokens: int | None = None) -> int:
    """One request of `seq_len` tokens: each layer holds min(seq_len, its window) tokens, rounded
    up to whole blocks when `block_size` is given."""
    kv = kv_cache_spec(spec, dtype, tp, group_size, block_size or 1, key_group_tokens)
    return kv.bytes_per_request(seq_len, whole_blocks=bool(block_size))


def max_concurrency(kv_cache_tokens: int, context_len: int) -> float:
    """vLLM's startup figure: KV cache tokens / tokens per request ("25.00x")."""
    return kv_cache_tokens / context_len


# -- weights --------------------------------------------------------------------------------
WEIGHT_FORMATS = ("auto", "fp32", "fp16", "bf16", "fp8", "int8", "awq", "gptq", "int4")


def resolve_weight_format(fmt: str, spec: ModelSpec) -> tuple[str, int]:
    """(format, group size) with "auto" read from config.json's quantization_config/dtype."""
    fmt = fmt.strip().lower()
    fmt = short_dtype_name(fmt) or fmt
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    q = spec.quantization
    group = int(q.get("group_size") or 128) if q else 128
    if fmt != "auto":
        return fmt, group
    method = str(q.get("quant_method", "")).lower() if q else ""
    if method in ("awq", "gptq"):
        if int(q.get("bits", 4)) == 8:
            return "int8", group
        return method, group
    if method in ("fp8", "compressed-tensors") and q.get("weight_block_size") is not None:
        return "fp8", group
    if method == "fp8":
        return "fp8", group
    return spec.dtype, group


def weight_bytes_per_param(fmt: str, group_size: int = 128, fp8_block: int | None = None) -> float:
    """Bytes per quantized parameter, scales included.

    int4 (AWQ, GPTQ): half a byte, plus per group of `group_size` input channels an fp16 scale
    (2 bytes) and a packed int4 zero point (0.5 byte). int8: one byte (per-channel scales are
    negligible). fp8: one byte, plus a float32 scale per fp8_block x fp8_block tile if block-wise.
    """
    if fmt == "fp32":
        return 4.0
    if fmt in ("fp16", "bf16"):
        return 2.0
    if fmt == "fp8":
        return 1.0 + (4.0 / (fp8_block * fp8_block) if fp8_block else 0.0)
    if fmt == "int8":
        return 1.0
    if fmt in ("awq", "gptq", "int4"):
        if group_size <= 0:
            raise ValueError(f"group size must be positive, got {group_size}")
        return 0.5 + 2.5 / group_size
    raise ValueError(f"unknown weight format {fmt!r}")


def weight_bytes(spec: ModelSpec, fmt: str = "auto", group_size: int | None = None,
                 tp: int = 1) -> int:
    """Weight memory per GPU. Quantized formats keep the embeddings (and an untied LM head) in
    16 bits, as AWQ, GPTQ and fp8 checkpoints do."""
    fmt, default_group = resolve_weight_format(fmt, spec)
    group = group_size or default_group
    if fmt in ("fp32", "fp16", "bf16"):
        total = spec.num_params * weight_bytes_per_param(fmt)
    else:
        block = spec.quantization.get("weight_block_size") if spec.quantization else None
        fp8_block = int(block[0]) if block else None
        embed = min(spec.embedding_params, spec.num_params)
        total = embed * 2 + (spec.num_params - embed) * weight_bytes_per_param(fmt, group,
                                                                             fp8_block)
    return int(round(total / tp))


# -- request lengths and fragmentation ------------------------------------------------------

def parse_length_distribution(text: str, seed: int = 0, samples: int = 100_000) -> list[int]:
    """Request lengths (prompt + output tokens) from a spec:

    fixed:N, uniform:A:B (every length in [A, B] once), normal:MEAN:STD, lognormal:MEDIAN:SIGMA
    (sampled, seeded), or file:PATH (one length per line, or a JSONL trace whose records carry
    input_length/output_length or token_ids)."""
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    args = rest.split(":") if rest else []
    try:
        if kind == "fixed" and len(args) == 1:
            n = int(args[0])
            if n <= 0:
                raise ValueError
            return [n]
        if kind == "uniform" and len(args) == 2:
            a, b = int(args[0]), int(args[1])
            if not 0 < a <= b:
                raise ValueError
            if b - a > 1_000_000:
                rng = random.Random(seed)
                return [rng.randint(a, b) for _ in range(samples)]
            return list(range(a, b + 1))
        if kind in ("normal", "lognormal") and len(args) == 2:
            m, s = float(args[0]), float(args[1])
            if m <= 0 or s < 0:
                raise ValueError
            rng = random.Random(seed)
            if kind == "normal":
                return [max(1, round(rng.gauss(m, s))) for _ in range(samples)]
            return [max(1, round(rng.lognormvariate(math.log(m), s))) for _ in range(samples)]
        if kind == "file" and rest:
            return _lengths_from_file(Path(rest))
    except ValueError:
        pass
    raise ValueError(f"cannot read length distribution {text!r}; use fixed:N, uniform:A:B, "
                     "normal:MEAN:STD, lognormal:MEDIAN:SIGMA or file:PATH")


def _lengths_from_file(path: Path) -> list[int]:
    import json

    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line[0] == "{":
                rec = json.loads(line)
                n = rec.get("input_length")
                if n is None:
                    n = len(rec.get("token_ids") or rec.get("prompt_token_ids") or ())
                out.append(int(n) + int(rec.get("output_length") or 0))
            else:
                out.append(int(line))
    if not out:
        raise ValueError(f"{str(path)!r} holds no lengths")
    return out


@dataclass(frozen=True)
class Fragmentation:
    block_size: int
    mean_length: float
    expected_waste_tokens: float  # per request: the unused tail of its last block
    waste_frac_of_allocated: float  # of the KV memory requests hold
    overhead_frac_of_used: float  # waste / tokens actually stored
    rule_of_thumb: float  # half a block per request: (block_size / 2) / mean length

    def as_dict(self) -> dict:
        return dict(block_size=self.block_size, mean_length=self.mean_length,
                    expected_waste_tokens=self.expected_waste_tokens,
                    waste_frac_of_allocated=self.waste_frac_of_allocated,
                    overhead_frac_of_used=self.overhead_frac_of_used,
                    rule_of_thumb=self.rule_of_thumb)


def fragmentation(block_size: int, lengths: Sequence[int]) -> Fragmentation:
    """Expected internal fragmentation of paged blocks over a length distribution (each
    length equally likely). A request never wastes more than block_size - 1 tokens; when lengths
    spread over many blocks the tail is ~uniform, so the average is ~half a block."""
    if block_size <= 0 or not lengths:
        raise ValueError("need a positive block size and at least one length")
    used = sum(lengths)
    allocated = sum(-(-n // block_size) * block_size for n in lengths)
    waste = allocated - used
    mean = used / len(lengths)
    return Fragmentation(block_size, mean, waste / len(lengths), waste / allocated,
                         waste / used, (block_size / 2) / mean)


# -- the plan -------------------------------------------------------------------------------

def make_plan(spec: ModelSpec, *, kv_dtype: str = "auto", context_len: int | None = None,
              gpu_memory: int | None = None, gpu_memory_utilization: float = 0.9,
              weight_format: str = "auto", weights: int | None = None,
              group_size: int | None = None, reserve: int = 2 * 10**9, block_size: int = 16,
              tensor_parallel_size: int = 1, concurrency: int | None = None,
              max_num_seqs: int = 256, lengths: str | None = None,
              kv_group_size: int | None = None, kv_cache_memory: int | None = None,
              num_gpu_blocks: int | None = None, gpu_name: str | None = None,
              quantization: str | None = None) -> dict:
    """Everything `kvserve plan` prints, as a dict with stable keys (the --json output).
    `quantization` names the engine quantization `weights` was counted for (kvserve plan
    --quantization: the engine's own count, not a size the user gave)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tp = tensor_parallel_size
    kv_dtype = resolve_kv_dtype(kv_dtype, spec)
    L = context_len or spec.max_position_embeddings
    if gpu_memory is None:
        from kvserve.planner.presets import GPUS_MIB

        gpu_name = gpu_name or "h100-80gb"
        gpu_memory = GPUS_MIB[gpu_name] * 2**20
    warnings: list[str] = []
    if L > spec.max_position_embeddings:
        warnings.append(f"context length {L:,} exceeds the model's max_position_embeddings "
                        f"({spec.max_position_embeddings:,})")

    kg = block_size  # int4 keys: one block is one group of tokens, as in the engine
    per_token = kv_bytes_per_token(spec, kv_dtype, tp, kv_group_size, kg)
    per_request = kv_bytes_per_request(spec, kv_dtype, L, None, tp, kv_group_size, kg)
    per_request_blocks = kv_bytes_per_request(spec, kv_dtype, L, block_size, tp, kv_group_size,
                                              kg)
    block_bytes = per_token * block_size

    fmt, default_group = resolve_weight_format(weight_format, spec)
    w_group = group_size or default_group
    w_bytes = weights if weights is not None else weight_bytes(spec, fmt, w_group, tp)
    usable = round(gpu_memory * gpu_memory_utilization)  # 80e9 x 0.92 is 73,599,999,999.99...
    pool = usable - w_bytes - reserve
    if kv_cache_memory is not None:
        pool = kv_cache_memory
    if pool <= 0 and num_gpu_blocks is None:
        warnings.append(f"weights ({w_bytes / 1e9:.2f} GB) and reserve ({reserve / 1e9:.2f} GB) "
                        f"exceed usable memory ({usable / 1e9:.2f} GB): no room for a KV cache")
    blocks = int(num_gpu_blocks if num_gpu_blocks is not None else max(0, pool) // block_bytes)
    pool_used = blocks * block_bytes
    tokens = blocks * block_size
    # Full-attention models: tokens / L (vLLM's figure). With sliding layers a request needs
    # less than L tokens on some layers, so divide memory by a request's real footprint.
    concurrency_x = pool_used / per_request_blocks if per_request_blocks else float("inf")
    max_requests = int(concurrency_x + 1e-9)

    targets = [concurrency] if concurrency else \
        sorted({max(1, int(max_requests * f)) for f in (0.25, 0.5, 0.75)}) if max_requests else []
    rooms = []
    for n in targets:
        left = pool_used - n * per_request_blocks
        rooms.append(dict(concurrency=n, bytes=max(0, left),
                          tokens=max(0, left) // per_token if per_token else 0,
                          frac=max(0.0, left / pool_used) if pool_used else 0.0))
    if concurrency and concurrency > max_requests:
        warnings.append(f"{concurrency} concurrent requests of {L:,} tokens do not fit "
                        f"(at most {max_requests})")

    blocks_per_request = -(-L // block_size)
    dist_text = lengths or f"uniform:1:{L}"
    dist = parse_length_distribution(dist_text)
    frag = fragmentation(block_size, dist)
    mean_alloc = frag.mean_length + frag.expected_waste_tokens
    frag_dict = frag.as_dict()
    frag_dict.update(
        length_distribution=dist_text,
        paged_concurrency=tokens / mean_alloc if mean_alloc else 0.0,
        contiguous_waste_frac=max(0.0, 1 - frag.mean_length / L),
        contiguous_concurrency=float(tokens // L),
        by_block_size={str(b): fragmentation(b, dist).as_dict()["waste_frac_of_allocated"]
                       for b in (1, 8, 16, 32, 64, 128, 256)})

    dtypes = {}
    for name in KV_DTYPES:
        pt = kv_bytes_per_token(spec, name, tp, kv_group_size, kg)
        pr = kv_bytes_per_request(spec, name, L, None, tp, kv_group_size, kg)
        prb = kv_bytes_per_request(spec, name, L, block_size, tp, kv_group_size, kg)
        bb = pt * block_size
        nb = int(max(0, pool) // bb) if num_gpu_blocks is None else \
            int(num_gpu_blocks * block_bytes // bb)
        dtypes[name] = dict(bytes_per_token=pt, bytes_per_request=pr,
                            max_concurrency=nb * bb / prb if prb else 0.0)

    data_only = kv_cache_spec(spec, kv_dtype, tp, kv_group_size, 1, kg).data_bytes_per_token

    return {
        "model": dict(name=spec.name, source=spec.source, architecture=spec.architecture,
                      attention=spec.attention, num_layers=spec.num_layers,
                      hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                      kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim,
                      vocab_size=spec.vocab_size, num_params=spec.num_params,
                      params_source=spec.params_source, dtype=spec.dtype,
                      max_position_embeddings=spec.max_position_embeddings,
                      sliding_window_layers=spec.num_sliding_layers,
                      sliding_windows=sorted({w for w in spec.windows if w is not None})),
        "kv": dict(dtype=kv_dtype, context_len=L, block_size=block_size,
                   tensor_parallel_size=tp,
                   bytes_per_token_per_layer=kv_bytes_per_token_layer(spec, kv_dtype, tp,
                                                                      kv_group_size, kg),
                   bytes_per_token=per_token, bytes_per_request=per_request,
                   bytes_per_request_blocks=per_request_blocks, bytes_per_block=block_bytes,
                   scale_overhead_frac=per_token / data_only - 1 if data_only else 0.0),
        "memory": dict(gpu=gpu_name, device_bytes=int(gpu_memory),
                       gpu_memory_utilization=gpu_memory_utilization, usable_bytes=int(usable),
                       weight_format=fmt, weight_group_size=w_group if fmt in
                       ("awq", "gptq", "int4") else None,
                       weight_bytes=int(w_bytes),
                       weights_given=weights is not None and quantization is None,
                       quantization=quantization,
                       reserve_bytes=int(reserve), kv_pool_bytes=int(max(0, pool)),
                       tensor_parallel_size=tp),
        "capacity": dict(num_blocks=blocks, kv_cache_tokens=tokens,
                         max_concurrency=concurrency_x, max_concurrent_requests=max_requests,
                         prefix_room=rooms, mla_saving=_mla_saving(spec)),
        "block_table": dict(bytes_per_request=blocks_per_request * 4,
                            frac_of_request_kv=(blocks_per_request * 4) / per_request_blocks
                            if per_request_blocks else 0.0,
                            max_num_seqs=max_num_seqs,
                            preallocated_bytes=max_num_seqs * blocks_per_request * 4),
        "fragmentation": frag_dict,
        "dtypes": dtypes,
        "warnings": warnings,
    }
