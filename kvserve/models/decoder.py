"""One config-driven decoder for Llama, Qwen2, Qwen3, Mistral, Gemma 3 (text), Phi-3 and OLMo 2;
which architecture sets which switch is `kvserve/models/`' business, one module per family.

Gemma 3 is the same decoder with a few switches from its config: embeddings scaled by
sqrt(hidden_size), norms that scale by (1 + weight) (the loader stores 1 + weight, so the norm
code is shared), the attention and MLP outputs normed before their residual adds, per-head q/k
norms (as Qwen3), a GELU-tanh gate, the attention scale from `query_pre_attn_scalar`, a RoPE base
per layer type (local and global layers), and tanh soft-capping of the final logits.
Phi-3's partial RoPE is a RoPE table whose last frequencies are 0 (its weight map permutes the
q/k dimensions to match, `kvserve.models.weights.partial_rotary_rows`). OLMo 2 has the output
norms without the norms before attention and the MLP (`pre_norms` False: those ops then read
the residual stream as it is) and norms q and k over the whole projection, not per head.

The model runs on a flat batch: `T` new tokens from any number of sequences, with no batch
dimension and no padding. Everything that depends on which sequence a token belongs to (the
KV cache, masks) lives behind the `AttentionFn` the caller passes in.

Layout, chosen for the CPU hot path:
  * q, k and v projections are one matrix `qkv_proj` ([q; k; v] rows), gate and up are one
    matrix `gate_up_proj` ([gate; up] rows), so each layer runs four GEMMs;
  * the residual add is folded into the o_proj and down_proj GEMMs (`addmm_` with beta=1 writes
    straight into the residual stream, or oneDNN's "add" post-op, below), except with Gemma's
    output norms, which sit between the GEMM and the add;
  * RoPE uses Hugging Face's rotate-half convention (the first half of each head pairs with the
    second half), with cos/sin precomputed once in float32 and gathered once per step;
  * how each projection computes (which GEMM kernel, with which fused epilogues) is not this
    module's business: each part asks the `ExecutionPlan` it is built with for its method
    (`kvserve.layers.plan`) and keeps it. A layer runs its `DecoderMethod`'s `LayerMethods`
    for the step's row bucket, the LM head its `HeadMethod`, the token lookup its `Embedding`,
    and the model a one-call `decode_step` where the plan gives it one. After the loader has
    filled the weights, `process_weights_after_loading` lets each method make what it runs
    from them (packed or quantized copies); nothing assigns a method afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.base import AttentionFn, RowCut
from kvserve.layers.buckets import bucket_of
from kvserve.layers.plan import ExecutionPlan
from kvserve.layers.projection import Linear
from kvserve.layers.rotary import identity_rope_cache, rope_cache
from kvserve.models.config import ModelConfig
from kvserve.models.moe import MoE
from kvserve.layers.params import param as _param


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, plan: ExecutionPlan) -> None:
        super().__init__()
        c = config
        dtype, device = plan.dtype, plan.device
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_size = c.q_size
        self.qk_size = c.q_size + c.kv_size
        self.intermediate_size = c.intermediate_size
        self.eps = c.rms_norm_eps
        p = dict(dtype=dtype, device=device)
        h, qkv = c.hidden_size, c.q_size + 2 * c.kv_size
        self.hidden_size = h
        # The norm before attention (None without pre-norms: OLMo 2)
        self.input_layernorm = _param(h, **p) if c.pre_norms else None
        self.qkv_proj = Linear(qkv, h, plan, "qkv_proj", bias=c.attention_bias,
                               blocks=True)
        # Per head (Qwen3, Gemma 3): q_norm repeated over the q heads, then k_norm over the kv
        # heads, [heads + kv heads, head_dim], so that one normalisation covers q and k
        # together. Over the whole projection (OLMo 2): [q_size + kv_size], q's then k's.
        if not c.qk_norm:
            self.qk_norm = None
        elif c.qk_norm_per_head:
            self.qk_norm = _param(c.num_attention_heads + c.num_key_value_heads, c.head_dim, **p)
        else:
            self.qk_norm = _param(c.q_size + c.kv_size, **p)
        self.o_proj = Linear(h, c.q_size, plan, "o_proj", bias=c.o_proj_bias, blocks=True)
        # The norm before the MLP (Llama's post_attention_layernorm, Gemma's
        # pre_feedforward_layernorm; None without pre-norms).
        self.post_attention_layernorm = _param(h, **p) if c.pre_norms else None
        # Gemma 3, OLMo 2: norms of the attention and MLP outputs, before their residual adds.
        self.attn_out_norm = _param(h, **p) if c.output_norms else None
        self.mlp_out_norm = _param(h, **p) if c.output_norms else None
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        # The MLP: routed experts (Qwen3-MoE, Mixtral: `moe`) or one gated MLP
        self.moe = MoE(c.moe, h, plan) if c.moe is not None and c.moe.is_moe_layer(layer_idx) \
            else None
        dense = self.moe is None
        self.gate_up_proj = Linear(2 * c.intermediate_size, h, plan, "gate_up_proj",
                                   bias=c.mlp_bias, blocks=True) if dense else None
        self.down_proj = Linear(h, c.intermediate_size, plan, "down_proj",
                                bias=c.mlp_bias, blocks=True) if dense else None
        # How this layer computes: one LayerMethods per row bucket once prepared
        self.method = plan.decoder_method(config)

    def process_weights_after_loading(self) -> None:
        if self.moe is not None:
            self.moe.prepare()
        self.method.prepare(self)

    @property
    def quant_weights(self) -> dict:
        """The projections the method runs as blocks (attribute -> QuantWeight)."""
        return getattr(self.method, "weights", {})

    def gemm_flops_per_row(self) -> int:
        """FLOPs of this layer's projections per token (for the warm-up's budget)."""
        h = self.hidden_size
        qkv = self.q_size + 2 * self.num_kv_heads * self.head_dim
        return 2 * (h * qkv + self.q_size * h + 3 * h * self.intermediate_size)

    def warm_up_gemms(self, x: torch.Tensor, bucket: int) -> None:
        """Run each projection of row bucket `bucket` once on zeros x [rows, hidden] (compiles
        its oneDNN kernel; a dense one compiles nothing and costs little)."""
        ops = self.method.buckets[bucket]
        ops.attn_in(x, torch.zeros(x.shape[0], self.head_dim, dtype=x.dtype, device=x.device))
        zeros = torch.zeros(x.shape[0], self.q_size, dtype=x.dtype, device=x.device)
        ops.o_add(zeros, x.clone())
        ops.down_add(ops.mlp(x), x.clone())

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor,
                attn: AttentionFn, bucket: int = 0) -> torch.Tensor:
        """hidden [T, hidden_size] is the residual stream; it may be updated in place.
        `bucket` (bucket_of(T)) picks the methods for this size."""
        ops = self.method.buckets[bucket]
        q, k, v = ops.attn_in(hidden, cos_sin)
        o = attn(self.layer_idx, q, k, v).reshape(hidden.shape[0], self.q_size)
        if ops.o_mlp is not None:
            return ops.o_mlp(o, hidden)
        hidden = ops.o_add(o, hidden)
        chunk = self.method.mlp_chunk_rows
        if chunk is None or hidden.shape[0] <= chunk:
            return ops.down_add(ops.mlp(hidden), hidden)
        # A long prefill's MLP a chunk of rows at a time (see cpu_methods.mlp_chunk_rows)
        ops = self.method.buckets[bucket_of(chunk)]
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            out = ops.down_add(ops.mlp(h), h)
            if out.data_ptr() != h.data_ptr():  # a kernel that could not add in place
                h.copy_(out)
        return hidden


class CausalLM(nn.Module):
    """Parameters are allocated uninitialised; `kvserve.model_loader.loader` fills them and
    then calls `process_weights_after_loading`."""

    def __init__(self, config: ModelConfig, plan: ExecutionPlan) -> None:
        super().__init__()
        self.config = config
        self.plan = plan
        dtype, device = plan.dtype, plan.device
        self.dtype = dtype
        p = dict(dtype=dtype, device=device)
        # The token table ([vocab, hidden]) and the untied LM head: projections, each the
        # one owner of its weight (or of the file's blocks of it)
        self.embed_tokens = Linear(config.vocab_size, config.hidden_size, plan, "embed_tokens",
                                   blocks=True)
        self.layers = nn.ModuleList(self.make_layer(config, i, plan)
                                    for i in range(config.num_hidden_layers))
        self.norm = _param(config.hidden_size, **p)
        self.lm_head = None if config.tie_word_embeddings else \
            Linear(config.vocab_size, config.hidden_size, plan, "lm_head", blocks=True)
        self.register_buffer("rope_cos_sin", rope_cache(config, device), persistent=False)
        # Layers whose RoPE differs from the full layers' (Gemma 3's local layers, SmolLM3's
        # layers without RoPE) use a second table; layer i uses table self.rope_of_layer[i].
        self.rope_of_layer = [0] * config.num_hidden_layers
        local = None
        if config.sliding_rope_theta is not None:
            local = rope_cache(config, device, config.sliding_rope_theta)
            self.rope_of_layer = [int(w is not None) for w in config.windows]
        elif not all(config.rope_layers):  # SmolLM3's NoPE layers: a table that rotates nothing
            local = identity_rope_cache(config, device)
            self.rope_of_layer = [int(not r) for r in config.rope_layers]
        self.register_buffer("rope_cos_sin_local", local, persistent=False)
        # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype as transformers
        # scales them; a buffer, built once and moved with the model, not a tensor per forward.
        self.register_buffer("embed_scale", None if config.embed_scale is None else
                             torch.tensor(config.embed_scale, dtype=dtype, device=device),
                             persistent=False)
        self._softcap = config.final_logit_softcapping
        self._logit_divisor = config.logits_scaling  # Granite: logits / logits_scaling
        # How the token lookup, the LM head (a LinearMethod per row bucket) and the final norm
        # compute, and the decode step that runs every layer in one call where the plan has
        # one (`serves(rows)`: the rows its kernels were chosen for at load; `run` returns
        # None where the attention backend has no kernel arguments for the step)
        self.embed = plan.embedding(config)
        self.head = plan.head_method(config)
        self.final_norm = plan.final_norm()
        self.decode_step = plan.one_call_decode(config)

    def make_layer(self, config: ModelConfig, index: int, plan: ExecutionPlan) -> nn.Module:
        """One decoder layer; an architecture with its own layers (DeepSeek's MLA and MoE,
        `kvserve.models.deepseek_layers`) overrides this and keeps the rest of the model."""
        return DecoderLayer(config, index, plan)

    def process_weights_after_loading(self) -> None:
        """Each part's method makes what it runs from the loaded weights (vLLM's name):
        packed and quantized copies, bound kernels. Called once, by the loader."""
        self.embed.prepare(self)
        for layer in self.layers:
            layer.process_weights_after_loading()
        self.head.prepare(self)
        if self.decode_step is not None:
            self.decode_step.prepare(self)

    def limit_positions(self, n: int) -> None:
        """Keep only the RoPE tables' first `n` rows (the engine's max_model_len, which no
        position reaches). Built for max_position_embeddings, Llama 3's 131,072 positions
        are 33.5 MB of float32 at head_dim 64 (67 MB at 128) that a 4,096-token engine
        never reads: memory beside the weights that a user could not predict."""
        for name in ("rope_cos_sin", "rope_cos_sin_local"):
            table = getattr(self, name)
            if table is not None and table.shape[0] > n:
                setattr(self, name, table[:n].clone())

    @property
    def device(self) -> torch.device:
        """Where the model runs (its final norm's device: every float tensor's; the table
        may be held as blocks alone)."""
        return self.norm.device

    def head_weight(self) -> torch.Tensor | None:
        """The LM head's float weight (the embedding table where they are tied); None where
        only the file's blocks of it are held."""
        return self.head_projection().weight

    def head_projection(self) -> Linear:
        """The LM head's projection (the embedding table's where they are tied)."""
        return self.lm_head if self.lm_head is not None else self.embed_tokens

    @property
    def gemm_plan(self):
        """The GEMM plan the model runs (`gemm_select.GemmPlan`), or None (F.linear)."""
        return self.plan.source.describe(self)

    @property
    def packed(self) -> bool:
        """Whether any weight runs through oneDNN (whose shapes a server warms up)."""
        plan = self.gemm_plan
        return plan is not None and any("onednn" in ks for ks in plan.kernels.values())

    @property
    def quant_embed(self):
        return getattr(self.embed, "weight", None)

    @property
    def quant_head(self):
        return getattr(self.head, "weight", None)

    def warm_up_layers(self) -> list[nn.Module]:
        """One layer of each distinct GEMM shape set (every DecoderLayer has the same)."""
        return [self.layers[0]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn, between: RowCut | None = None) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden_size].
        `between(i, hidden)`, called after each layer i, may return (rows to keep, the
        attention for the rows kept): the later layers run those rows only (document reuse's
        selective recompute, kvserve/worker/row_select.py); the result has those rows."""
        hidden = self.embed(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        tables = [self.rope_cos_sin.index_select(0, positions).to(self.dtype)]
        if self.rope_cos_sin_local is not None:
            tables.append(self.rope_cos_sin_local.index_select(0, positions).to(self.dtype))
        if between is None and self.decode_step is not None \
                and self.decode_step.serves(hidden.shape[0]) and self.decode_step.run(
                    hidden, tables[self.rope_of_layer[0]], attn) is not None:
            return self.final_norm(hidden, self.norm, self.config.rms_norm_eps)
        bucket = bucket_of(hidden.shape[0])
        for i, (layer, rope) in enumerate(zip(self.layers, self.rope_of_layer)):
            hidden = layer(hidden, tables[rope], attn, bucket)
            cut = between(i, hidden) if between is not None else None
            if cut is not None:
                keep, attn = cut
                hidden, tables = hidden[keep], [t[keep] for t in tables]
                bucket = bucket_of(hidden.shape[0])
        return self.final_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, bucket_rows: int | None = None
                       ) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]. `bucket_rows`: the row
        count whose bucket's kernel runs (default N): a speculative verification's rows are
        one sequence's, so the runner gives the step's sequences, and a verification at batch
        1 runs the head a one-token decode runs (the same bits, near ties included)."""
        rows = hidden.shape[0] if bucket_rows is None else bucket_rows
        logits = self.head.buckets[bucket_of(rows)].apply(hidden).float()
        if self._logit_divisor is not None:
            logits = logits.div_(self._logit_divisor)
        if self._softcap is not None:
            logits = logits.div_(self._softcap).tanh_().mul_(self._softcap)
        return logits
