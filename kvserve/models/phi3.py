"""Phi-3 (`Phi3ForCausalLM`: Phi-3 mini/medium, Phi-4): a Llama-style pre-norm decoder whose
checkpoints store q/k/v as one `self_attn.qkv_proj` and gate/up as one `mlp.gate_up_proj`.

Differences from Llama, as transformers' modeling_phi3.py computes them:
  * fused projections: the decoder's own layout ([q; k; v] rows, [gate; up] rows, gate first:
    Phi3MLP's `gate, up = gate_up.chunk(2)`), so the weight map copies them whole;
  * partial RoPE (`partial_rotary_factor`, in rope_parameters or at the top level): only the
    first rotary_dim dimensions of each head rotate, pairing i with i + rotary_dim/2; the
    weight map permutes the q/k rows so the decoder's full-head RoPE does exactly that
    (`weights.partial_rotary_rows`);
  * no biases anywhere, rms_norm_eps 1e-5 and 4,096 positions by default;
  * `sliding_window` (Phi-3-mini-4k: 2,047) on every layer, read by the shared layer_windows;
  * residual dropouts, which are the identity at inference.
Not supported, and refused by name: "longrope" (also spelt "su"; Phi-3-128k, Phi-3.5, Phi-4-mini),
whose factors switch with the sequence's length.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.fields import decoder_fields, gated_activation, rope_fields
from kvserve.models.weights import Layout, decoder_weights, partial_rotary_rows

_LAYOUT = Layout(fused_qkv=True, fused_gate_up=True)


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=4096, eps=1e-5)
    f["hidden_act"] = gated_activation(d, arch)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("longrope", "su",
                                                                               "yarn"):
        raise ValueError("Phi-3's longrope RoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) is not "
                         "supported; only rope_type 'default'")
    f.update(rope_fields(d, f["max_position_embeddings"], supported=("default",), partial=True))
    factor = f.pop("partial_rotary_factor", None)
    if factor is not None:
        rotary = int(f["head_dim"] * factor)
        if not 0 < rotary <= f["head_dim"] or rotary % 2:
            raise ValueError(f"partial_rotary_factor={factor} gives {rotary} rotary dimensions "
                             f"of head_dim {f['head_dim']}: must be even and positive")
        f["rotary_dim"] = rotary
    return f


def _weights(model: Any, config: Any) -> dict:
    targets = decoder_weights(model, config, _LAYOUT)
    rows = partial_rotary_rows(config)
    if rows is None:
        return targets
    return {name: replace(t, transform=rows) if name.endswith(".self_attn.qkv_proj.weight")
            else t for name, t in targets.items()}


PHI3 = Family(config=_config, model=decoder_model, weights=_weights,
              make_config=partial(transformers_config, "Phi3Config", sliding_window=None))
