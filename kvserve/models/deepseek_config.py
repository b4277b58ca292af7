"""DeepSeek-V2/V3's extra hyper-parameters: multi-head latent attention (MLA) and the
mixture-of-experts MLP, read from a Hugging Face `config.json`.

`parse_mla` is the one reader of the MLA dimensions: the engine's `ModelConfig` and the planner's
`ModelSpec` both call it, so the bytes per token the planner prints are those the engine's KV
pool allocates. Defaults are transformers 5's `DeepseekV2Config` / `DeepseekV3Config` defaults
for keys a config.json leaves out. Nothing here imports the rest of the model package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """Per layer: q through an optional low-rank bottleneck (`q_lora_rank`, None = a full q_proj
    as in V2-Lite), keys and values through one latent of `kv_lora_rank` shared by every head,
    plus a decoupled RoPE key of `qk_rope_head_dim` (also shared). The KV cache holds only the
    latent and the RoPE key: `latent_dim` values per token per layer."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True  # checkpoints store the RoPE dims as (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Layers from `first_k_dense_replace` on replace the dense MLP by `n_shared_experts` always-on
    experts plus `num_experts_per_tok` of `n_routed_experts` routed ones.

    Gating as transformers implements it: V2 scores with a softmax and picks greedily
    (`topk_method` "greedy") or within the `topk_group` best of `n_group` groups ("group_limited_
    greedy"), scaled by `routed_scaling_factor` (transformers' V2 ignores `norm_topk_prob`);
    V3 scores with a sigmoid, picks by score + `e_score_correction_bias` within the groups whose
    two best experts sum highest ("noaux_tc"), weights by the plain sigmoid score, normalised
    when `norm_topk_prob`, then scaled. Qwen3-MoE and Mixtral: a softmax, greedy top-k, the
    k weights normalised to sum to 1 (`norm_topk_prob`; V2's adapter always sets it False, as
    transformers' V2 ignores the key)."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Layers that keep a dense MLP besides the first first_k_dense_replace (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer not in self.dense_layers


def parse_mla(d: dict[str, Any]) -> MLAConfig | None:
    """The MLA dimensions of a config, or None when it has no `kv_lora_rank` (not MLA). Raises
    ValueError naming the key at fault."""
    if not d.get("kv_lora_rank"):
        return None
    v3 = _is_v3(d)
    q_lora = d.get("q_lora_rank", 1536)
    return MLAConfig(
        kv_lora_rank=_int(d, "kv_lora_rank", 512),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", 64, even=True),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", 128),
        v_head_dim=_int(d, "v_head_dim", 128),
        q_lora_rank=None if q_lora is None else _int(d, "q_lora_rank", 1536),
        rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
    )


def parse_moe(d: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoE layout of a DeepSeek config, or None when it has no routed experts."""
    if not d.get("n_routed_experts"):
        return None
    v3 = _is_v3(d)
    experts = _int(d, "n_routed_experts", 0)
    top_k = _int(d, "num_experts_per_tok", 0)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts ({experts})")
    freq = d.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise ValueError(f"moe_layer_freq={freq} is not supported (transformers implements 1)")
    first_dense = d.get("first_k_dense_replace", 3 if v3 else 0) or 0
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ValueError(f"first_k_dense_replace must be an integer >= 0, got {first_dense!r}")
    if v3:
        scoring, method = "sigmoid", "noaux_tc"
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"DeepSeek-V3 scoring_func {d['scoring_func']!r} is not supported "
                             "(transformers implements 'sigmoid')")
        groups = d.get("n_group", 8)
        topk_group = d.get("topk_group", 4)
    else:
        scoring = "softmax"
        method = d.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported for DeepSeek-V2 "
                             "(greedy, group_limited_greedy)")
        if d.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"DeepSeek-V2 scoring_func {d['scoring_func']!r} is not supported "
                             "(transformers implements 'softmax')")
        groups = d.get("n_group") if method == "group_limited_greedy" else 1
        topk_group = d.get("topk_group") if method == "group_limited_greedy" else 1
    groups = _int({"n_group": groups}, "n_group", 1)
    topk_group = _int({"topk_group": topk_group}, "topk_group", 1)
    if experts % groups:
        raise ValueError(f"n_routed_experts ({experts}) is not a multiple of n_group ({groups})")
    if topk_group > groups:
        raise ValueError(f"topk_group ({topk_group}) exceeds n_group ({groups})")
    if v3 and experts // groups < 2:
        raise ValueError("DeepSeek-V3 gating ranks groups by their two best experts: each of "
                         f"the {groups} groups needs at least 2 of the {experts} experts")
    if top_k > topk_group * (experts // groups):
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the experts of the "
                         f"{topk_group} selected group(s)")
    scaling = d.get("routed_scaling_factor", 2.5 if v3 else 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
        raise ValueError(f"routed_scaling_factor must be positive, got {scaling!r}")
    shared = d.get("n_shared_experts", 1 if v3 else 2) or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"n_shared_experts must be an integer >= 0, got {shared!r}")
    return MoEConfig(
        n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=_int(d, "moe_intermediate_size", 1407),
        n_shared_experts=shared, first_k_dense_replace=min(first_dense, num_layers),
        scoring=scoring, topk_method=method, n_group=groups, topk_group=topk_group,
        norm_topk_prob=bool(d.get("norm_topk_prob", v3)) if v3 else False,
        routed_scaling_factor=float(scaling))


def _is_v3(d: dict[str, Any]) -> bool:
    archs = d.get("architectures") or []
    return "DeepseekV3ForCausalLM" in archs or d.get("model_type") == "deepseek_v3"


def _int(d: dict[str, Any], key: str, default: int, even: bool = False) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if even and value % 2:
        raise ValueError(f"{key} must be even for rotary embeddings, got {value}")
    return value
