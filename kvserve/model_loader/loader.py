"""Load a Hugging Face safetensors checkpoint (or a GGUF file) into the model its architecture's
registry entry names (`kvserve.models.registry`), built with the `ExecutionPlan` the caller
chose (`kvserve.worker.model_build` makes it; this module imports no kernel).

The model is built with uninitialised parameters, then every checkpoint tensor is copied (and
cast) straight into the place the family's weight map gives it: q/k/v into row ranges of
`qkv_proj`, gate/up into `gate_up_proj`, Qwen3's (and Gemma 3's) q_norm/k_norm broadcast over
their heads, Gemma's norm weights w stored as 1 + w. Nothing is initialised twice and no
intermediate concatenations are built. A GGUF file's block-format weights the plan's methods
take as they are (`accepts_blocks`) are handed to the projection that owns them
(`Linear.take_blocks`: each weight map target names its projection). Then the model's
`process_weights_after_loading` lets its methods make what they run. What is
architecture-specific lives in the family modules; this file only reads files and copies.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kvserve.utils import hugepages, quant_formats
from kvserve.layers.plan import ExecutionPlan
from kvserve.model_loader.gguf_checkpoint import GGUFCheckpoint, is_gguf, open_gguf
from kvserve.model_loader.gguf_checkpoint.dequant import TORCH_TYPES
from kvserve.models import registry
from kvserve.models.base import Target
from kvserve.models.config import ModelConfig
from kvserve.models.decoder import CausalLM

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
# (kvserve/layers/quantize_at_load.py)
QUANTIZATIONS = quant_formats.QUANTIZATIONS
# For a GGUF file on the CPU: measured on the default model (SmolLM2-135M, Q4_1 projections,
# Q8_0 head), AVX-512 VNNI Xeon, 2 threads, batch-1 decode after a 128-token prompt: 99.3
# tok/s kept quantized against 48.2 dequantized to float32 (medians of 5 interleaved runs);
# a 128-token prefill 0.144 s against 0.112 (its GEMMs run on dequantized copies).
DEFAULT_QUANTIZATION = "gguf"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: str | Path) -> tuple[ModelConfig, GGUFCheckpoint | None]:
    """The model's config (config.json, or a GGUF file's metadata) and the open GGUF file
    (None for a safetensors checkpoint); every problem is a ValueError."""
    gguf = open_gguf(model_dir) if is_gguf(model_dir) else None
    return registry.config_from_dir(Path(model_dir) if gguf is None else gguf.dir), gguf


def load_checkpoint(model_dir: str | Path, plan: ExecutionPlan, model_config: ModelConfig,
                    config: ModelConfig | None = None, gguf: GGUFCheckpoint | None = None,
                    shard: "RankLayout | None" = None) -> CausalLM:
    """Build `model_config`'s model with `plan`, fill it from `model_dir` (safetensors, or the
    open GGUF file `gguf`, its tensors dequantized into the model dtype where the plan does
    not take their blocks), and let its methods prepare; raises ValueError on any problem
    with the checkpoint, naming the file or tensor at fault.

    `shard` (a tensor-parallel rank's layout, kvserve/model_loader/tp_layout.py, with
    `model_config` the rank's part of `config`, the whole model's) reads only the rank's
    slice of each tensor."""
    config = config or model_config
    model_dir = Path(model_dir)
    family = registry.get(config.architecture).family
    files = checkpoint_files(model_dir) if gguf is None else []
    with torch.no_grad():
        model = family.model()(model_config, plan)
        targets = family.weights(model, model_config)
        if shard is not None:
            from kvserve.model_loader.tp_shard import shard_targets

            targets = shard_targets(targets, shard, config)
        loaded: set[str] = set()
        for file in files:
            _load_file(file, targets, loaded, config, family.skip)
        if gguf is not None:
            _load_gguf(gguf, targets, loaded, config, model)
    missing = sorted(set(targets) - loaded, key=_natural_key)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)"
                                           if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing tensor(s): {shown}")
    del targets  # views of the float weights: let them go as methods replace them
    model.eval()
    with torch.no_grad():
        model.process_weights_after_loading()
    return model


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


def _quantized_groups(model: CausalLM, work: list[tuple]) -> list[tuple]:
    """The projections whose checkpoint tensors are each of a block type the kernels run
    (for the K-quants: with k a multiple of 256), copied plainly into whole rows of the
    projection's weight and covering all of it: [(projection, [(tensor, first row)])].
    Each target names its projection (`Target.owner`), so nothing is found by address.

    The parts of a fused projection may differ in type where it runs the plain or the
    residual mode (qkv: llama.cpp's Q4_K_M gives attn_v another type than attn_q/attn_k, and
    where a row is not a multiple of 256, as SmolLM2's 576, its quantizer falls back to
    Q5_0 / Q8_0 per tensor): kept as several parts, a kernel call per type. The gated
    gate | up needs one type (one kernel computes both halves) and stays dense otherwise.
    The embedding table and the LM head are projections too ("embed_tokens", "lm_head":
    one type, `accepts_blocks` says)."""
    groups: dict[int, tuple] = {}
    for tensor, target in work:
        owner = target.owner
        if owner is None or not owner.blocks or len(tensor.shape) != 2 or owner.weight is None \
                or owner.weight.device.type != "cpu":
            continue
        groups.setdefault(id(owner), (owner, []))[1].append((tensor, target))
    kept = []
    for owner, parts in groups.values():
        types = {t.info.type_name for t, _ in parts}
        if not model.plan.source.accepts_blocks(owner.role, types, owner.in_features) \
                or any(tg.transform is not None or tg.offset or tg.part is not None
                       for _, tg in parts) \
                or sum(tg.dest.shape[0] for _, tg in parts) != owner.out_features:
            continue
        kept.append((owner, sorted(((t, tg.first_row) for t, tg in parts),
                                   key=lambda part: part[1])))
    return kept


def _stacked(parts: list[tuple], k: int) -> quant_formats.FileBlocks:
    """One projection's checkpoint tensors (in row order) as its file's blocks: consecutive
    parts of one type in one buffer, a new part where the type changes. The buffers are on
    2 MiB pages (`hugepages`): a batch-1 decode streams them once a token, and on 4 KiB pages
    the 1B Q4_K_M model's layers took 24.4 ms a step against 22.3 (Zen 4 EPYC, 2 threads)."""
    runs: list[list] = []
    for tensor, _ in parts:
        if runs and runs[-1][0] == tensor.info.type_name:
            runs[-1][1].append(tensor)
        else:
            runs.append([tensor.info.type_name, [tensor]])
    out = []
    for type_name, ts in runs:  # each tensor copied once, from the file into its rows
        data = hugepages.empty((sum(t.shape[0] for t in ts), ts[0].row_bytes), torch.uint8)
        rows, row = data.numpy(), 0
        for t in ts:
            t.raw_rows(rows[row: row + t.shape[0]])
            row += t.shape[0]
        out.append((type_name, data))
    return quant_formats.FileBlocks(tuple(out), k)


def _keep_quantized(model: CausalLM, work: list[tuple], loaded: set[str]) -> list[tuple]:
    """Hand the block-format projections of `work` to their projections (`take_blocks`: the
    float weight dropped; it was never written, so it never took memory). The embedding
    table, where the plan's methods run its type, is one of them (a tied LM head then runs
    it too); an untied head keeps its float copy beside the blocks for Q8_0 (whose x stays
    float at a few rows), not for the other types (an 8B Q4_K_M file's Q6_K head was 806 MB
    in float32). Returns the rest of `work`, to dequantize."""
    groups = _quantized_groups(model, work)
    taken = set()
    for owner, parts in groups:
        head_copy = owner.role == "lm_head" and parts[0][0].info.type_name == "Q8_0"
        owner.take_blocks(_stacked(parts, owner.in_features), keep_float=head_copy)
        if head_copy:  # its float copy is dequantized too
            continue
        for tensor, _ in parts:
            loaded.add(tensor.name)
            taken.add(id(tensor))
    rest = [item for item in work if id(item[0]) not in taken]
    kinds = sorted({item[0].info.type_name for item in rest})
    layers = [g for g in groups if g[0].role not in ("embed_tokens", "lm_head")]
    table = model.embed_tokens.file_blocks
    logger.info("quantization gguf: %d projections kept in their block format (%s), the "
                "embedding table %s; dequantized at load: %d tensors (%s)", len(layers),
                ", ".join(sorted({t.info.type_name for g in layers for t, _ in g[1]}))
                or "none",
                f"too ({table.type_names[0]})" if table is not None else "not", len(rest),
                ", ".join(kinds) or "none")
    return rest


def _load_gguf(gguf: GGUFCheckpoint, targets: dict[str, Target], loaded: set[str],
               config: ModelConfig, model: CausalLM) -> None:
    """Every GGUF tensor dequantized (in float32) into its place; Gemma 3 GGUFs hold 1 + w in
    their norms already, so no offset is added there. Where the model's plan keeps blocks, the
    projections its quantized methods run stay in their block format (`_keep_quantized`)."""
    where = f"GGUF file {str(gguf.path)!r}"
    work = []
    for tensor in gguf.tensors():
        # the name the architecture's weight map has, of those llama.cpp maps to this tensor
        tensor.name = next((n for n in tensor.names if n in targets), tensor.name)
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
    if model.plan.source.keeps_blocks:
        work = _keep_quantized(model, work, loaded)

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
