"""Checkpoint weight maps onto the shared decoder (`kvserve.models.decoder.CausalLM`): every
Hugging Face tensor name -> the slice of the fused parameter it fills.

The decoder keeps q, k and v in one `qkv_proj` ([q; k; v] rows) and gate and up in one
`gate_up_proj` ([gate; up] rows), so a checkpoint with separate projections fills row ranges,
and one that stores them fused (Phi-3) fills the whole matrix. Families differ in what their
norms are called and where they sit (`Layout.norms`), in whether q/k norms are per head or over
the whole projection (the parameter's shape says), and in Gemma's 1 + w norms
(`Layout.norm_offset`); everything else is one function.

Entries are made in checkpoint order (embedding, layers, final norm, LM head): make-model draws
random weights in this order, so the order is part of what a seed means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.models.base import Target

if TYPE_CHECKING:
    import torch

    from kvserve.models.config import ModelConfig

# decoder norm parameter -> the name most checkpoints give it
LLAMA_NORMS = {"input_layernorm": "input_layernorm",
               "post_attention_layernorm": "post_attention_layernorm"}


@dataclass(frozen=True)
class Layout:
    """How a family names the decoder's parameters in its checkpoints.

    norms: decoder norm parameter (input_layernorm, post_attention_layernorm = the norm before
    the MLP, attn_out_norm, mlp_out_norm) -> the checkpoint's name under model.layers.{i}.;
    fused_qkv / fused_gate_up: the checkpoint stores self_attn.qkv_proj / mlp.gate_up_proj
    whole; norm_offset: added to every norm weight after the copy (Gemma: 1 + w); moe_block
    and experts: a routed-experts layer's module (its router is `gate`) and each expert's
    (gate, up, down) names (Qwen3-MoE's mlp and gate/up/down_proj, Mixtral's
    block_sparse_moe and w1/w3/w2)."""

    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    fused_qkv: bool = False
    fused_gate_up: bool = False
    norm_offset: float = 0.0
    moe_block: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


class WeightMap:
    """An ordered {checkpoint name: Target} under construction."""

    def __init__(self, norm_offset: float = 0.0) -> None:
        self.targets: dict[str, Target] = {}
        self.norm_offset = norm_offset

    def add(self, name: str, dest: torch.Tensor, shape: tuple[int, ...] | None = None,
            transform: Any = None) -> None:
        self.targets[name] = Target(dest, tuple(dest.shape) if shape is None else shape,
                                    transform=transform)

    def norm(self, name: str, dest: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
        self.targets[name] = Target(dest, tuple(dest.shape) if shape is None else shape,
                                    self.norm_offset)

    def gated_mlp(self, prefix: str, gate_up: torch.Tensor, down: torch.Tensor,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, fused: bool = False) -> None:
        """gate_proj / up_proj (or one gate_up_proj) into [gate; up] rows, then down_proj."""
        inter = gate_up.shape[0] // 2
        if fused:
            self.add(prefix + "gate_up_proj.weight", gate_up)
        else:
            self.add(prefix + "gate_proj.weight", gate_up[:inter])
            self.add(prefix + "up_proj.weight", gate_up[inter:])
        self.add(prefix + "down_proj.weight", down)
        if gate_up_bias is not None:
            if fused:
                self.add(prefix + "gate_up_proj.bias", gate_up_bias)
            else:
                self.add(prefix + "gate_proj.bias", gate_up_bias[:inter])
                self.add(prefix + "up_proj.bias", gate_up_bias[inter:])
        if down_bias is not None:
            self.add(prefix + "down_proj.bias", down_bias)

    def embedding(self, model: Any) -> None:
        self.add("model.embed_tokens.weight", model.embed_tokens)

    def final(self, model: Any) -> None:
        """The final norm and, when the model has its own, the LM head (tied: the embedding)."""
        self.norm("model.norm.weight", model.norm)
        if model.lm_head is not None:
            self.add("lm_head.weight", model.lm_head)


def decoder_weights(model: Any, config: ModelConfig, layout: Layout) -> dict[str, Target]:
    """The weight map of a `CausalLM` under `layout`'s names."""
    c = config
    q, kv = c.q_size, c.kv_size
    w = WeightMap(layout.norm_offset)
    w.embedding(model)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for param in ("input_layernorm", "post_attention_layernorm", "attn_out_norm",
                      "mlp_out_norm"):
            dest = getattr(layer, param)
            if dest is not None:
                w.norm(p + layout.norms[param] + ".weight", dest)
        if layout.fused_qkv:
            w.add(a + "qkv_proj.weight", layer.qkv_proj)
        else:
            for n, rows in zip("qkv", (slice(0, q), slice(q, q + kv), slice(q + kv, None))):
                w.add(f"{a}{n}_proj.weight", layer.qkv_proj[rows])
        if layer.qkv_bias is not None:
            for n, rows in zip("qkv", (slice(0, q), slice(q, q + kv), slice(q + kv, None))):
                w.add(f"{a}{n}_proj.bias", layer.qkv_bias[rows])
        if layer.qk_norm is not None:
            if layer.qk_norm.dim() == 2:  # per head: [heads + kv heads, head_dim], broadcast
                h = c.num_attention_heads
                w.norm(a + "q_norm.weight", layer.qk_norm[:h], (c.head_dim,))
                w.norm(a + "k_norm.weight", layer.qk_norm[h:], (c.head_dim,))
            else:  # over the whole projection: [q_size + kv_size]
                w.norm(a + "q_norm.weight", layer.qk_norm[:q])
                w.norm(a + "k_norm.weight", layer.qk_norm[q:])
        w.add(a + "o_proj.weight", layer.o_proj)
        if layer.o_bias is not None:
            w.add(a + "o_proj.bias", layer.o_bias)
        if layer.moe is not None:
            _experts(w, f"{p}{layout.moe_block}.", layer.moe, layout.experts)
            continue
        w.gated_mlp(p + "mlp.", layer.gate_up_proj, layer.down_proj, layer.gate_up_bias,
                    layer.down_bias, layout.fused_gate_up)
    w.final(model)
    return w.targets


def _experts(w: WeightMap, prefix: str, moe: Any, names: tuple[str, str, str]) -> None:
    """A routed-experts layer: the router, then each expert's gate and up into its [gate; up]
    rows and its down projection."""
    w.add(prefix + "gate.weight", moe.gate)
    gate, up, down = names
    i = moe.w13.shape[1] // 2
    for e in range(moe.w13.shape[0]):
        w.add(f"{prefix}experts.{e}.{gate}.weight", moe.w13[e][:i])
        w.add(f"{prefix}experts.{e}.{up}.weight", moe.w13[e][i:])
        w.add(f"{prefix}experts.{e}.{down}.weight", moe.w2[e])


def partial_rotary_rows(config: ModelConfig):
    """A transform for a fused [q; k; v] weight (or bias) whose heads rotate only their first
    `rotary_dim` dimensions (transformers' partial RoPE: dimension i pairs with i + rotary_dim/2),
    or None when every dimension rotates.

    Why a permutation: the decoder's RoPE (and every kernel that fuses it) pairs dimension i
    with i + head_dim/2. Within each q and k head the rows are reordered to [rotated first half,
    pass-through first half, rotated second half, pass-through second half]; the RoPE table
    gives the pass-through positions frequency 0 (cos 1, sin 0: `rope_inv_freq`), so they pass
    unrotated. q and k are permuted alike, so every q.k product, and so the attention, is
    transformers'; v is untouched."""
    r, d = config.rotary_dim, config.head_dim
    if r is None or r == d:
        return None
    import torch

    half, rest = r // 2, (d - r) // 2
    head = torch.tensor([*range(half), *range(r, r + rest), *range(half, r),
                         *range(r + rest, d)])
    heads = config.num_attention_heads + config.num_key_value_heads
    qk = (torch.arange(heads)[:, None] * d + head[None, :]).flatten()
    index = torch.cat((qk, torch.arange(heads * d, heads * d + config.kv_size)))
    return lambda w: w.index_select(0, index)
