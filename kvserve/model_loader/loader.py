"""Load a Hugging Face safetensors checkpoint (or a GGUF file) into the model its architecture's
registry entry names (`kvserve.models.registry`).

The model is built with uninitialised parameters, then every checkpoint tensor is copied (and
cast) straight into the place the family's weight map gives it: q/k/v into row ranges of
`qkv_proj`, gate/up into `gate_up_proj`, Qwen3's (and Gemma 3's) q_norm/k_norm broadcast over
their heads, Gemma's norm weights w stored as 1 + w. Nothing is initialised twice and no
intermediate concatenations are built. What is architecture-specific lives in the family
modules; this file only reads files and copies.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kvserve import features as F
from kvserve import quant_formats
from kvserve.dtypes import DTYPES, canonical_dtype, to_torch_dtype
from kvserve.models.config import ModelConfig
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.kernels.cpu import qgemv
from kvserve.layers import selection
from kvserve.layers.quant_linear import (PROJECTION_ATTRS, QuantWeight, StackedQuantWeight,
                                         kept_as_blocks)
from kvserve.models.decoder import CausalLM, DecoderLayer
from kvserve.model_loader.gguf_checkpoint import GGUFCheckpoint, is_gguf, open_gguf
from kvserve.model_loader.gguf_checkpoint.dequant import TORCH_TYPES
from kvserve.models import registry
from kvserve.models.base import Target

if TYPE_CHECKING:
    from kvserve.model_loader.tp_layout import RankLayout

logger = logging.getLogger("kvserve")

# Buffers some checkpoints carry that the model recomputes.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# fp8 KV-cache scales (vLLM's spellings: self_attn.k_scale, self_attn.attn.k_scale,
# self_attn.k_proj.k_scale, compressed-tensors' self_attn.k_proj.output_scale): read by
# `read_kv_scales`, not weights.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_proj\.)?"
                       r"(?:([kv])_scale|output_scale)$")

# load_model's quantization: "gguf" keeps a GGUF file's block formats, "none" dequantizes,
# "q8_0" / "q4_0" / "q4_1" / "q4_k" quantize a float checkpoint's projections at load
# (kvserve/model_loader/quantize_at_load.py)
QUANTIZATIONS = quant_formats.QUANTIZATIONS
# For a GGUF file on the CPU: measured on the default model (SmolLM2-135M, Q4_1 projections,
# Q8_0 head), AVX-512 VNNI Xeon, 2 threads, batch-1 decode after a 128-token prompt: 99.3
# tok/s kept quantized against 48.2 dequantized to float32 (medians of 5 interleaved runs);
# a 128-token prefill 0.144 s against 0.112 (its GEMMs run on dequantized copies).
DEFAULT_QUANTIZATION = "gguf"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig,
                  device: str | torch.device = "cpu") -> torch.dtype:
    """"auto" takes config.json's dtype (float32 when absent), except that on a CPU without
    bf16 instructions (AVX512_BF16 or AMX) a bf16/fp16 checkpoint runs in float32: there half
    precision is emulated, many times slower, not faster. An explicit "bfloat16" on such a
    CPU is honoured with a warning that says what it costs (`half_precision_cost`)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in [to_torch_dtype(name) for name in DTYPES]:
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        chosen, auto = dtype, False
    else:
        name = (config.torch_dtype or "float32") if dtype == "auto" else canonical_dtype(dtype)
        if name is None:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        chosen, auto = to_torch_dtype(name), dtype == "auto"
    if torch.device(device).type != "cpu" or chosen == torch.float32 or cpu_info().has_bf16:
        return chosen
    if auto:
        logger.info("dtype auto: this CPU has no bf16 instructions (AVX512_BF16/AMX), so the "
                    "%s checkpoint runs in float32", str(chosen).split(".")[-1])
        return torch.float32
    logger.warning("dtype=%s on a CPU without bf16 instructions (%s): a GEMM takes %.1fx as long "
                   "as in float32 here (measured); dtype='float32' or 'auto' is faster",
                   str(chosen).split(".")[-1], cpu_info().summary(), half_precision_cost(chosen))
    return chosen


def half_precision_cost(dtype: torch.dtype, n: int = 256) -> float:
    """How many times longer an n x n x n matmul takes in `dtype` than in float32 on this CPU
    (best of 3; small enough to finish fast where the half-precision path is emulated)."""
    import time

    def best(dt: torch.dtype) -> float:
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        torch.mm(a, b)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(dtype) / max(best(torch.float32), 1e-9)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu",
               pack_weights: bool = True, gemm: str | None = None,
               remeasure_kernels: bool = False,
               quantization: str | None = None,
               shard: "RankLayout | None" = None) -> tuple[CausalLM, ModelConfig]:
    """Read config.json and the safetensors weights of `model_dir`, or a GGUF file (its tensors
    dequantized into the model dtype); raises ValueError on any problem with the checkpoint,
    naming the file or tensor at fault.

    With `pack_weights` (the default) each projection gets the GEMM kernel that measures
    fastest on this CPU per batch size (`kvserve.layers.selection.pack_weights`; `gemm` = "auto", "onednn",
    "dense", "gemv" or "panel", default $KVSERVE_GEMM or "auto"); the logits are the same up
    to float rounding either way; `remeasure_kernels` measures them again rather than reading
    the choice cached for this CPU and model shape. Without it every GEMM stays dense
    (F.linear).

    `quantization` (vLLM's name): "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/
    Q6_K projections and embedding table in their block format, run by the quantized kernels
    (kvserve/layers/quant_linear.py; float32 on the CPU only, where the kernels build);
    "none" dequantizes every tensor at load; None is DEFAULT_QUANTIZATION for a GGUF file on
    the CPU, else "none". "q8_0", "q4_0", "q4_1" and "q4_k" quantize a float checkpoint's
    projections at load into those block formats (quantize_at_load.py; float32 on the CPU:
    dtype "auto" means float32 there).

    `shard` (a tensor-parallel rank's layout, kvserve/model_loader/tp_layout.py) builds that rank's
    part of the model and reads only its slice of each tensor; nothing is packed here
    (kvserve/parallel/layers.py binds the rank's methods around its collectives) and a GGUF
    file is dequantized. The config returned is the whole model's."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None, the default), "
                         f"got {quantization!r}")
    model_dir = Path(model_dir)
    gguf = open_gguf(model_dir) if is_gguf(model_dir) else None
    at_load = quantization in quant_formats.AT_LOAD
    if at_load:
        dtype, device = _at_load_dtype(quantization, dtype, device, gguf is not None)
    config = registry.config_from_dir(model_dir if gguf is None else gguf.dir)
    family = registry.get(config.architecture).family
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = resolve_dtype(dtype, config, device)
    device = torch.device(device)
    files = checkpoint_files(model_dir) if gguf is None else []
    model_config = config
    if shard is not None:
        from kvserve.model_loader.tp_layout import rank_config

        if at_load:
            F.refuse(F.TENSOR_PARALLEL, F.QUANTIZE_AT_LOAD)
        model_config, quantization, pack_weights = rank_config(config, shard), "none", False
    with torch.no_grad():
        model = family.model()(model_config, torch_dtype, device)
        targets = family.weights(model, model_config)
        if shard is not None:
            from kvserve.model_loader.tp_shard import shard_targets

            targets = shard_targets(targets, shard, config)
        loaded: set[str] = set()
        for file in files:
            _load_file(file, targets, loaded, config, family.skip)
        keep = gguf is not None and _keeps_blocks(quantization, torch_dtype, device)
        if gguf is not None:
            _load_gguf(gguf, targets, loaded, config, model if keep else None)
    missing = sorted(set(targets) - loaded, key=_natural_key)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)"
                                           if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing tensor(s): {shown}")
    model.eval()
    if at_load:
        from kvserve.model_loader.quantize_at_load import quantize_model

        del targets  # views of the float projections: let them go as each is quantized
        quantize_model(model, quantization)
    if any(getattr(layer, "quant_weights", None) for layer in model.layers) \
            or getattr(model, "quant_embed", None) is not None:
        selection.bind_quantized(model)  # with or without pack_weights: no float copies
    if pack_weights:
        selection.pack_weights(model, gemm or os.environ.get("KVSERVE_GEMM", "auto"),
                               remeasure_kernels)
    return model, config


def read_kv_scales(model_dir: str | Path, num_layers: int) -> torch.Tensor | None:
    """The checkpoint's fp8 KV scales as [layers, 2] (k_scale, v_scale), or None when it has
    none (a GGUF file never has); a checkpoint with some but not all of them is refused
    (ValueError)."""
    if is_gguf(model_dir):
        return None
    found: dict[tuple[int, int], float] = {}
    for file in checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                m = _KV_SCALE.match(key)
                if m is None:
                    continue
                which = m.group(3) or m.group(2)
                if which is None:
                    continue
                found[(int(m.group(1)), "kv".index(which))] = float(f.get_tensor(key).float()
                                                                      .reshape(-1)[0])
    if not found:
        return None
    missing = [f"layer {i} {'kv'[j]}_scale" for i in range(num_layers) for j in range(2)
               if (i, j) not in found]
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has KV scales for some layers but "
                         f"not {', '.join(missing[:6])}")
    bad = [v for v in found.values() if not 0 < v < float("inf")]  # NaN fails too
    if bad:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has KV scales that are not "
                         f"positive and finite: {bad[:4]}")
    return torch.tensor([[found[(i, 0)], found[(i, 1)]] for i in range(num_layers)])


def checkpoint_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json, or (failing
    both) every *.safetensors file in the directory."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError) as e:
            raise ValueError(f"cannot read shard index {str(index)!r}: {e!r}") from e
        files = [model_dir / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"shard(s) listed in {str(index)!r} not found: {absent}")
        if not files:
            raise ValueError(f"shard index {str(index)!r} lists no files")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(model_dir)!r} (expected {SINGLE_FILE} "
                         f"or {INDEX_FILE} with its shards)")
    return files


def _load_file(file: Path, targets: dict[str, Target], loaded: set[str],
               config: ModelConfig, skip: Callable[[str, ModelConfig], bool] | None) -> None:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for bad headers/lengths
        raise ValueError(f"cannot read safetensors file {str(file)!r} (corrupted or "
                         f"truncated?): {e}") from e
    with handle as f:
        for key in f.keys():
            if _IGNORED.match(key) or _KV_SCALE.match(key) or (skip and skip(key, config)):
                continue
            name = key  # the model tensor this checkpoint tensor fills
            if key == "lm_head.weight" and config.tie_word_embeddings:
                # Tied: the embedding matrix is the LM head. Some exports keep only this copy;
                # use it unless the embedding itself has been loaded (if it comes later, it
                # overwrites this).
                name = "model.embed_tokens.weight"
                if name in loaded:
                    continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"unexpected tensor {key!r} in {str(file)!r} for "
                                 f"{config.architecture} with {config.num_hidden_layers} layers")
            try:
                part = f.get_slice(key)
                shape = tuple(part.get_shape())
                if shape != target.shape:
                    raise ValueError(f"tensor {key!r} in {str(file)!r} has shape "
                                     f"{list(shape)}, expected {list(target.shape)}")
                if target.part is None:
                    tensor = f.get_tensor(key)
                else:  # a tensor-parallel rank's range: only it is read from the file
                    dim, start, stop = target.part
                    tensor = part[(slice(None),) * dim + (slice(start, stop),)]
            except ValueError:
                raise
            except Exception as e:  # safetensors' own error types
                raise ValueError(f"cannot read tensor {key!r} from {str(file)!r}: {e}") from e
            if not tensor.is_floating_point():
                raise ValueError(f"tensor {key!r} in {str(file)!r} has dtype {tensor.dtype}; "
                                 "expected a floating-point tensor (quantised checkpoints are "
                                 "not supported)")
            _copy(target, tensor, loaded, name)


def _copy(target: Target, tensor: torch.Tensor, loaded: set[str], name: str) -> None:
    if target.part is not None and tuple(tensor.shape) == target.shape:  # a whole GGUF tensor
        dim, start, stop = target.part
        tensor = tensor.narrow(dim, start, stop - start)
    target.dest.copy_(tensor if target.transform is None else target.transform(tensor))
    if target.offset:
        target.dest.add_(target.offset)
    loaded.add(name)


def _keeps_blocks(quantization: str | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GGUF file's block formats stay quantized (see load_model)."""
    if quantization is None:  # the default: where the kernels run, else as before
        if DEFAULT_QUANTIZATION == "none" or device.type != "cpu" or dtype != torch.float32:
            return False
    elif quantization == "none":
        return False
    elif device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization='gguf' runs on the CPU in float32 only (the quantized "
                         f"kernels are C++ CPU kernels), not {device.type} {dtype}; use "
                         "quantization='none' to dequantize the weights at load")
    if qgemv.load() is None:
        logger.warning("quantization: the quantized kernels cannot be built here; the GGUF "
                       "weights are dequantized at load")
        return False
    return True


def _at_load_dtype(quantization: str, dtype: str | torch.dtype,
                   device: str | torch.device, is_gguf_file: bool) -> tuple:
    """(dtype, device) of a quantize-at-load model: float32 ("auto" included) on the CPU
    ("auto" included)."""
    if is_gguf_file:
        raise ValueError(f"quantization={quantization!r} quantizes a float safetensors "
                         "checkpoint; a GGUF file's own block formats run with "
                         "quantization='gguf' (or None)")
    dtype = "float32" if dtype == "auto" else dtype
    device = "cpu" if device == "auto" else device
    f32 = dtype == torch.float32 if isinstance(dtype, torch.dtype) \
        else canonical_dtype(dtype) == "float32"
    if torch.device(device).type != "cpu" or not f32:
        raise ValueError(f"quantization={quantization!r} runs on the CPU in float32 only (the "
                         f"quantized kernels are C++ CPU kernels), not {device} {dtype}")
    return dtype, device


def _owners(model: CausalLM) -> list[tuple[int, int, object, str, torch.Tensor]]:
    """(start, end address, layer, attribute, parameter) of every float projection the loader
    may keep quantized."""
    found = []
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):  # DeepSeek's MLA / MoE: no quantized methods
            continue
        for attr in PROJECTION_ATTRS:
            p = getattr(layer, attr, None)
            if isinstance(p, torch.Tensor) and p.dim() == 2 and p.device.type == "cpu":
                found.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(),
                              layer, attr, p))
    return found


def _quantized_groups(model: CausalLM, work: list[tuple]) -> dict[tuple[int, str], tuple]:
    """The projections whose checkpoint tensors are each of a block type the kernels run
    (for the K-quants: with k a multiple of 256), copied plainly into whole rows of the
    parameter and covering all of it:
    (id(layer), attribute) -> (layer, attribute, parameter, [(tensor, first row)]).

    The parts of a fused projection may differ in type where it runs the plain or the
    residual mode (qkv: llama.cpp's Q4_K_M gives attn_v another type than attn_q/attn_k, and
    where a row is not a multiple of 256, as SmolLM2's 576, its quantizer falls back to
    Q5_0 / Q8_0 per tensor): kept as a StackedQuantWeight, a kernel call per type. The gated
    gate | up needs one type (one kernel computes both halves) and stays dense otherwise."""
    owners = _owners(model)
    groups: dict[tuple[int, str], list] = {}
    for tensor, target in work:
        dest = target.dest
        if dest.dim() != 2 or not dest.is_contiguous():
            continue
        ptr = dest.data_ptr()
        for start, end, layer, attr, p in owners:
            if start <= ptr < end:
                row_bytes = p.shape[1] * p.element_size()
                if dest.shape[1] == p.shape[1] and (ptr - start) % row_bytes == 0:
                    groups.setdefault((id(layer), attr), [layer, attr, p, []])[3].append(
                        (tensor, target, (ptr - start) // row_bytes))
                break
    kept = {}
    for key, (layer, attr, p, parts) in groups.items():
        types = {t.info.type_name for t, _, _ in parts}
        if not kept_as_blocks(attr, types, p.shape[1]) \
                or any(tg.transform is not None or tg.offset for _, tg, _ in parts) \
                or sum(tg.dest.shape[0] for _, tg, _ in parts) != p.shape[0]:
            continue
        kept[key] = (layer, attr, p, sorted(((t, row) for t, _, row in parts),
                                            key=lambda part: part[1]))
    return kept


def _stacked(parts: list[tuple], k: int) -> QuantWeight | StackedQuantWeight:
    """One projection's checkpoint tensors (in row order) as its blocks: consecutive parts
    of one type in one QuantWeight, a StackedQuantWeight where the type changes."""
    runs: list[list] = []
    for tensor, _ in parts:
        if runs and runs[-1][0] == tensor.info.type_name:
            runs[-1][1].append(tensor)
        else:
            runs.append([tensor.info.type_name, [tensor]])
    weights = []
    for type_name, ts in runs:  # each tensor copied once, into its rows (no second copy)
        data = torch.empty((sum(t.shape[0] for t in ts), qgemv.row_bytes(type_name, k)),
                           dtype=torch.uint8)
        row = 0
        for t in ts:
            data[row: row + t.shape[0]].copy_(torch.from_numpy(t.raw_rows()))
            row += t.shape[0]
        weights.append(QuantWeight.for_kernels(data, type_name, k))
    return weights[0] if len(weights) == 1 else StackedQuantWeight(tuple(weights))


def _keep_quantized(model: CausalLM, work: list[tuple], loaded: set[str]) -> list[tuple]:
    """Keep the block-format projections of `work` as `layer.quant_weights` (the float
    parameter dropped: it was never written, so it never took memory); the embedding table,
    where the kernels run its type, as `model.quant_embed` (`embed_tokens` left empty),
    which a tied LM head shares as `model.quant_head`; an untied head's Q8_0 table also as
    `model.quant_head` (beside its float copy). Returns the rest of `work`, to dequantize."""
    groups = _quantized_groups(model, work)
    taken = set()
    for layer, attr, p, parts in groups.values():
        if getattr(layer, "quant_weights", None) is None:
            layer.quant_weights = {}
        layer.quant_weights[attr] = _stacked(parts, p.shape[1])
        for tensor, _ in parts:
            loaded.add(tensor.name)
            taken.add(id(tensor))
        setattr(layer, attr, None)
    for tensor, _ in work:
        if tensor.name != "model.embed_tokens.weight" or not _runs(tensor):
            continue
        model.quant_embed = _quant_weight(tensor)
        if model.lm_head is None:
            model.quant_head = model.quant_embed
        model.embed_tokens = torch.nn.Parameter(model.embed_tokens.new_empty(
            (0, tensor.shape[1])), requires_grad=False)
        loaded.add(tensor.name)
        taken.add(id(tensor))
    for tensor, _ in work:  # a Q8_0 copy of an untied head's table (selection.bind_quantized)
        if tensor.name == "lm_head.weight" and tensor.info.type_name == "Q8_0" \
                and _runs(tensor):
            model.quant_head = _quant_weight(tensor)
    rest = [item for item in work if id(item[0]) not in taken]
    kinds = sorted({item[0].info.type_name for item in rest})
    table = getattr(model, "quant_embed", None)
    logger.info("quantization gguf: %d projections kept in their block format (%s), the "
                "embedding table %s; dequantized at load: %d tensors (%s)", len(groups),
                ", ".join(sorted({t.info.type_name for g in groups.values() for t, _ in g[3]}))
                or "none",
                f"too ({table.type_name})" if table is not None else "not", len(rest),
                ", ".join(kinds) or "none")
    return rest


def _runs(tensor) -> bool:
    """Whether the quantized kernels run this 2-D GGUF tensor as it is stored."""
    return len(tensor.shape) == 2 and qgemv.fits(tensor.info.type_name, tensor.shape[1])


def _quant_weight(tensor) -> QuantWeight:
    return QuantWeight.for_kernels(torch.from_numpy(tensor.raw_rows()), tensor.info.type_name,
                                   tensor.shape[1])


def _load_gguf(gguf: GGUFCheckpoint, targets: dict[str, Target], loaded: set[str],
               config: ModelConfig, keep_blocks: CausalLM | None = None) -> None:
    """Every GGUF tensor dequantized (in float32) into its place; Gemma 3 GGUFs hold 1 + w in
    their norms already, so no offset is added there. With `keep_blocks` (the model), the
    projections the quantized kernels run stay in their block format (`_keep_quantized`)."""
    where = f"GGUF file {str(gguf.path)!r}"
    work = []
    for tensor in gguf.tensors():
        target = targets.get(tensor.name)
        if target is None:
            raise ValueError(f"unexpected tensor {tensor.info.name!r} ({tensor.name}) in {where} "
                             f"for {config.architecture} with {config.num_hidden_layers} layers")
        if tensor.shape != target.shape:
            raise ValueError(f"tensor {tensor.info.name!r} in {where} has shape "
                             f"{list(tensor.shape)}, expected {list(target.shape)}")
        if gguf.norms_hold_one_plus_w:
            target = replace(target, offset=0.0)
        work.append((tensor, target))
    if keep_blocks is not None:
        work = _keep_quantized(keep_blocks, work, loaded)

    def fill(item: tuple) -> None:
        tensor, target = item
        part = target.part
        with torch.no_grad():  # (a thread's own grad mode: it does not inherit the caller's)
            if part is not None and part[0] == 0 and len(tensor.shape) == 2:
                data = tensor.dequantize_rows(part[1], part[2])  # a rank's rows only
            else:
                data = tensor.dequantize()
            _copy(target, data, loaded, tensor.name)

    # The formats dequant.py decodes in torch run here, on torch's own threads; the others
    # (gguf.quants' numpy, which releases the GIL) on one Python thread per core.
    by_torch = [item for item in work if item[0].info.type_name in TORCH_TYPES]
    for item in by_torch:
        fill(item)
    rest = [item for item in work if item[0].info.type_name not in TORCH_TYPES]
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, rest))


def _natural_key(name: str) -> list[object]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]
