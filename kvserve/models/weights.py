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

    def linear(self, name: str, proj: Any, rows: slice | None = None,
               transform: Any = None) -> None:
        """`rows` of a projection's weight (all of it by default): a target that names its
        owner, so the loader can hand the file's blocks of it to the projection."""
        dest = proj.weight if rows is None else proj.weight[rows]
        self.targets[name] = Target(dest, tuple(dest.shape), transform=transform, owner=proj,
                                    first_row=0 if rows is None else rows.start or 0)

    def norm(self, name: str, dest: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
        self.targets[name] = Target(dest, tuple(dest.shape) if shape is None else shape,
                                    self.norm_offset)

    def gated_mlp(self, prefix: str, gate_up: Any, down: Any, fused: bool = False) -> None:
        """gate_proj / up_proj (or one gate_up_proj) into the [gate; up] rows of the
        `gate_up` projection, then down_proj, and their biases where they have them."""
        inter = gate_up.out_features // 2
        if fused:
            self.linear(prefix + "gate_up_proj.weight", gate_up)
        else:
            self.linear(prefix + "gate_proj.weight", gate_up, slice(0, inter))
            self.linear(prefix + "up_proj.weight", gate_up, slice(inter, None))
        self.linear(prefix + "down_proj.weight", down)
        if gate_up.bias is not None:
            if fused:
                self.add(prefix + "gate_up_proj.bias", gate_up.bias)
            else:
                self.add(prefix + "gate_proj.bias", gate_up.bias[:inter])
                self.add(prefix + "up_proj.bias", gate_up.bias[inter:])
        if down.bias is not None:
            self.add(prefix + "down_proj.bias", down.bias)

    def expert(self, prefix: str, w13: torch.Tensor, w2: torch.Tensor,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        """One routed expert: its gate and up into its [gate; up] rows of w13, its down into
        w2 (the experts' stacked tensors, not projections: they stay float)."""
        gate, up, down = names
        i = w13.shape[0] // 2
        self.add(f"{prefix}{gate}.weight", w13[:i])
        self.add(f"{prefix}{up}.weight", w13[i:])
        self.add(f"{prefix}{down}.weight", w2)

    def embedding(self, model: Any) -> None:
        self.linear("model.embed_tokens.weight", model.embed_tokens)

    def final(self, model: Any) -> None:
        """The final norm and, when the model has its own, the LM head (tied: the embedding)."""
        self.norm("model.norm.weight", model.norm)
        if model.lm_head is not None:
            self.linear("lm_head.weight", model.lm_head)


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
        qkv_rows = (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))
        if layout.fused_qkv:
            w.linear(a + "qkv_proj.weight", layer.qkv_proj)
        else:
            for n, rows in zip("qkv", qkv_rows):
                w.linear(f"{a}{n}_proj.weight", layer.qkv_proj, rows)
        if layer.qkv_proj.bias is not None:
            for n, rows in zip("qkv", qkv_rows):
                w.add(f"{a}{n}_proj.bias", layer.qkv_proj.bias[rows])
        if layer.qk_norm is not None:
            if layer.qk_norm.dim() == 2:  # per head: [heads + kv heads, head_dim], broadcast
                h = c.num_attention_heads
                w.norm(a + "q_norm.weight", layer.qk_norm[:h], (c.head_dim,))
                w.norm(a + "k_norm.weight", layer.qk_norm[h:], (c.head_dim,))
            else:  # over the whole projection: [q_size + kv_size]
                w.norm(a + "q_norm.weight", layer.qk_norm[:q])
                w.norm(a + "k_norm.weight", layer.qk_norm[q:])
        w.linear(a + "o_proj.weight", layer.o_proj)
        if layer.o_proj.bias is not None:
            w.add(a + "o_proj.bias", layer.o_proj.bias)
        if layer.moe is not None:
            _experts(w, f"{p}{layout.moe_block}.", layer.moe, layout.experts)
            continue
        w.gated_mlp(p + "mlp.", layer.gate_up_proj, layer.down_proj, layout.fused_gate_up)
    w.final(model)
    return w.targets


def _experts(w: WeightMap, prefix: str, moe: Any, names: tuple[str, str, str]) -> None:
    """A routed-experts layer: the router, then each expert's gate and up into its [gate; up]
    rows and its down projection."""
    w.add(prefix + "gate.weight", moe.gate)
    for e in range(moe.w13.shape[0]):
        w.expert(f"{prefix}experts.{e}.", moe.w13[e], moe.w2[e], names)


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
