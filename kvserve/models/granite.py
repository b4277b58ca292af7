"""Granite 3 (`GraniteForCausalLM`): Llama's decoder with four multipliers, as transformers'
modeling_granite.py applies them:
  * `embedding_multiplier`: the token embeddings times it (the decoder's `embed_scale`, which
    Gemma's sqrt(hidden_size) uses too);
  * `residual_multiplier`: each residual add is residual + m * output; m is folded into the
    o_proj and down_proj weights (and biases) as they are copied, so the decoder's fused
    residual adds run unchanged (the products differ from transformers' by float rounding);
    only this family's weight map reads it (`GraniteSettings`, the config's `family`);
  * `attention_multiplier`: the softmax scale itself, in place of 1/sqrt(head_dim);
  * `logits_scaling`: the logits divided by it.
Biases on q, k, v and o follow `attention_bias`, on the MLP `mlp_bias`; rms_norm_eps 1e-6 and
2,048 positions by default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.fields import llama_fields
from kvserve.models.weights import Layout, decoder_weights


@dataclass(frozen=True)
class GraniteSettings:
    """What only Granite's own code reads: the factor of each residual add's output."""

    residual_multiplier: float = 1.0


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = llama_fields(d, arch, max_positions=2048)
    f["embed_scale"] = float(d.get("embedding_multiplier", 1.0))
    f["family"] = GraniteSettings(float(d.get("residual_multiplier", 1.0)))
    f["attention_multiplier"] = float(d.get("attention_multiplier", 1.0))
    f["logits_scaling"] = float(d.get("logits_scaling", 1.0))
    return f


def _weights(model: Any, config: Any) -> dict:
    """Llama's names; the outputs that feed a residual add scaled by residual_multiplier."""
    targets = decoder_weights(model, config, Layout())
    m = config.family.residual_multiplier
    if m == 1.0:
        return targets
    scaled = (".self_attn.o_proj.weight", ".self_attn.o_proj.bias", ".mlp.down_proj.weight",
              ".mlp.down_proj.bias")
    return {name: replace(t, transform=lambda x: x * m) if name.endswith(scaled) else t
            for name, t in targets.items()}


GRANITE = Family(config=_config, model=decoder_model, weights=_weights,
                 make_config=partial(transformers_config, "GraniteConfig",
                                     embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.0078125, logits_scaling=8.0))
