"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's decoder in which some layers attend without RoPE
(`no_rope_layers[i]` 0; by default every fourth layer, `no_rope_layer_interval`), as
transformers' modeling_smollm3.py computes it. A NoPE layer runs the shared code on a RoPE
table that rotates nothing (`rope_layers`; the decoder's second table), so q and k pass
exactly as projected. Biases on q, k, v and o follow `attention_bias`, on the MLP `mlp_bias`;
tied embeddings by default; sliding windows (`use_sliding_window`, on the NoPE layers) are
read by the shared `layer_windows`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.fields import llama_fields
from kvserve.models.weights import Layout, decoder_weights


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = llama_fields(d, arch, max_positions=32768)
    f["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
    layers = f["num_hidden_layers"]
    rope = d.get("no_rope_layers")
    if rope is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rope, list) or len(rope) != layers:
        raise ValueError(f"no_rope_layers must list one 0/1 per layer ({layers}), got {rope!r}")
    f["rope_layers"] = tuple(bool(r) for r in rope)
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, Layout())


SMOLLM3 = Family(config=_config, model=decoder_model, weights=_weights,
                 make_config=partial(transformers_config, "SmolLM3Config"))
