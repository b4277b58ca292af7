"""The weight bytes a model holds, counted two ways that must agree (issue 31): `weight_bytes`
reads a loaded model (the engine's start-up line), `planned_weight_bytes` predicts it from the
config, the quantization and, for a GGUF file, the file's tensor types, without loading a
weight (`kvserve plan --quantization`). tests/test_weight_bytes.py holds them equal, and
equal to the resident memory a fresh process gains by loading the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvserve.utils import quant_formats
from kvserve.kernels.cpu import qgemv
from kvserve.layers.block import PROJECTION_ATTRS
from kvserve.layers.plan import ExecutionPlan
from kvserve.layers.quant_linear import kept_as_blocks
from kvserve.models.decoder import CausalLM, DecoderLayer


@dataclass(frozen=True)
class WeightBytes:
    total: int  # bytes of every weight the model holds: blocks and float tensors
    quantized: int  # of which block-quantized
    quantized_params: int  # values held in blocks
    params: int  # every weight value
    types: tuple[str, ...]  # the block formats held
    # packed kernels' copies of weights held beside them as well (a tied head's copy of the
    # table): memory the engine holds that no plan predicts (it depends on measured kernels)
    copies: int = field(default=0, compare=False)

    def line(self) -> str:
        """"weights 96.6 MB (q4_1/q8_0 blocks 96.4 MB, ...)" (the start-up line)."""
        copies = f"; packed copies beside them {_mb(self.copies)}" if self.copies else ""
        if not self.quantized:
            return f"weights {_mb(self.total)} (float{copies})"
        share = 100 * self.quantized_params / max(1, self.params)
        kinds = "/".join(t.lower() for t in self.types)
        return (f"weights {_mb(self.total)} ({kinds} blocks {_mb(self.quantized)}, {share:.0f}% "
                f"of params in quantized projections; float tensors "
                f"{_mb(self.total - self.quantized)}{copies})")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def weight_bytes(model: CausalLM) -> WeightBytes:
    """What `model` holds: its parameters (each once: each is its projection's or norm's own
    tensor, and a tied head is the table's projection itself, not a second parameter) plus
    its QuantWeights (the layers', the embedding table's and the LM head's, each once)."""
    total = params = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        params += p.numel()
    held = [w for layer in model.layers for w in (getattr(layer, "quant_weights", None)
                                                   or {}).values()]
    embed = getattr(model, "quant_embed", None)
    head = getattr(model, "quant_head", None)  # a copy of a float table, the table, or alone
    alone = head is not None and head is not embed and model.head_weight() is None
    # weight values held only as blocks
    values = [w for w in held + [embed] + ([head] if alone else []) if w is not None]
    unique = {id(w): w for w in values + ([head] if head is not None else [])}
    quantized = sum(w.nbytes for w in unique.values())
    qparams = sum(w.n * w.k for w in values)
    types = {t for w in unique.values() for t in getattr(w, "type_names", (w.type_name,))}
    packed = [getattr(layer, "method", None) for layer in model.layers] + [model.head]
    packed = [p.packed for p in packed if getattr(p, "packed", None) is not None]
    total += sum(p.bytes for p in packed)
    params += sum(p.values for p in packed)
    return WeightBytes(total + quantized, quantized, qparams, params + qparams,
                       tuple(sorted(types)), sum(p.copies for p in packed))


@dataclass(frozen=True)
class GGUFKept:
    """What the loader keeps in block format from a GGUF file (loader._keep_quantized's
    rules): projection -> (its parts' types, bytes in the file) per (layer, attribute); the
    embedding table's (type, bytes) where the kernels run it; an untied head's Q8_0 copy's
    bytes (beside its float table), or its (type, bytes) where it is kept alone (another type
    the kernels run)."""
    projections: dict[tuple[int, str], tuple[tuple[str, ...], int]] = \
        field(default_factory=dict)
    embed: tuple[str, int] | None = None
    head_copy: int = 0
    head: tuple[str, int] | None = None


# a fused projection's parts under their checkpoint names (a checkpoint that stores the fused
# tensor itself, as Phi-3's qkv_proj, is matched by the attribute's own name)
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def gguf_kept(checkpoint) -> GGUFKept:
    """The GGUFKept of an open GGUF checkpoint, from its tensor index alone."""
    # every checkpoint name llama.cpp maps to a tensor (Phi-3's fused qkv_proj among them)
    info = {n: t.info for t in checkpoint.tensors() for n in t.names}
    projections = {}
    layers = {int(name.split(".")[2]) for name in info
              if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    for i in sorted(layers):
        for attr, names in _PARTS.items():
            block = "mlp" if attr in ("gate_up_proj", "down_proj") else "self_attn"
            prefix = f"model.layers.{i}.{block}"
            parts = [info.get(f"{prefix}.{nm}.weight") for nm in names]
            if None in parts:
                parts = [info.get(f"{prefix}.{attr}.weight")]
            if None in parts:
                continue
            types = tuple(t.type_name for t in parts)
            if kept_as_blocks(attr, types, parts[0].shape[1]):
                projections[(i, attr)] = (types, sum(t.nbytes for t in parts))
    table = info.get("model.embed_tokens.weight")
    embed = (table.type_name, table.nbytes) if table is not None and len(table.shape) == 2 \
        and qgemv.fits(table.type_name, table.shape[1]) else None
    head = info.get("lm_head.weight")
    runs = head is not None and len(head.shape) == 2 and qgemv.fits(head.type_name,
                                                                   head.shape[1])
    head_copy = head.nbytes if runs and head.type_name == "Q8_0" else 0
    alone = (head.type_name, head.nbytes) if runs and head.type_name != "Q8_0" else None
    return GGUFKept(projections, embed, head_copy, alone)


def planned_weight_bytes(config, quantization: str | None,
                         kept: GGUFKept | None = None) -> WeightBytes:
    """The WeightBytes the engine will hold for `config` in float32 with `quantization`: an
    AT_LOAD name (every DecoderLayer projection in quant_formats' block format for its
    width), "gguf" with `kept` (`gguf_kept` of the file), or None / "none" (all float). The
    model is built on the meta device (no memory) and its parameters counted, the kept ones
    replaced by their blocks."""
    from kvserve.models import registry

    model = registry.get(config.architecture).family.model()(
        config, ExecutionPlan.dense(torch.float32, "meta"))
    gguf = quantization == "gguf"
    if gguf and kept is None:
        raise ValueError("quantization='gguf' is planned from a GGUF file's tensor types")
    seen: set[int] = set()
    total = params = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 4
            params += p.numel()
    quantized = qparams = 0
    types: set[str] = set()

    def keep(numel: int, type_names: tuple[str, ...], nbytes: int) -> None:
        nonlocal total, quantized, qparams
        total += nbytes - numel * 4
        quantized += nbytes
        qparams += numel
        types.update(type_names)

    if quantization in quant_formats.AT_LOAD or gguf:
        for i, layer in enumerate(model.layers):
            if not isinstance(layer, DecoderLayer):
                if not gguf:
                    raise ValueError(f"quantization={quantization!r}: {config.architecture}'s "
                                     "MLA / MoE layers have no quantized methods")
                continue
            for attr in PROJECTION_ATTRS:
                n, k = getattr(layer, attr).weight.shape
                if gguf:
                    found = kept.projections.get((i, attr))
                else:
                    type_name = quant_formats.projection_type(quantization, k)
                    found = ((type_name,), quant_formats.block_bytes(type_name, n, k)) \
                        if type_name else None
                if found is not None:
                    keep(n * k, *found)
    if gguf and kept.embed is not None:
        keep(math.prod(model.embed_tokens.weight.shape), (kept.embed[0],), kept.embed[1])
    if gguf and kept.head_copy and model.lm_head is not None:
        total += kept.head_copy
        quantized += kept.head_copy
        types.add("Q8_0")
    if gguf and kept.head is not None and model.lm_head is not None:
        keep(math.prod(model.lm_head.weight.shape), (kept.head[0],), kept.head[1])
    return WeightBytes(total, quantized, qparams, params, tuple(sorted(types)))


def planned_for_checkpoint(path: str, quantization: str) -> WeightBytes:
    """`planned_weight_bytes` for a checkpoint directory or a GGUF file, refusing what the
    loader refuses (at-load quantization of a GGUF file, "gguf" on a safetensors one)."""
    from pathlib import Path

    from kvserve.model_loader.gguf_checkpoint import is_gguf, open_gguf
    from kvserve.models import registry

    if quantization not in quant_formats.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {quant_formats.QUANTIZATIONS}, got "
                         f"{quantization!r}")
    source = Path(path)
    if not is_gguf(source) and not (source.is_dir() and (source / "config.json").is_file()):
        raise ValueError(f"--quantization plans the engine's own weights: give a checkpoint "
                         f"directory or a GGUF file, not {path!r}")
    checkpoint = open_gguf(source) if is_gguf(source) else None
    if checkpoint is not None and quantization in quant_formats.AT_LOAD:
        raise ValueError(f"quantization={quantization!r} quantizes a float safetensors "
                         "checkpoint; a GGUF file's own block formats run with "
                         "quantization='gguf'")
    if checkpoint is None and quantization == "gguf":
        raise ValueError("quantization='gguf' keeps a GGUF file's blocks; this checkpoint is "
                         "safetensors (q8_0, q4_0, q4_1 or q4_k quantize it at load)")
    config = registry.config_from_dir(source if checkpoint is None else checkpoint.dir)
    return planned_weight_bytes(config, quantization,
                                gguf_kept(checkpoint) if checkpoint is not None else None)
