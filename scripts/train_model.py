"""Train kvserve's embedded demo model, `stdlib-coder`, from the running Python's standard library.

Every machine with Python has the corpus, so anyone can reproduce the committed weights with one
command and no network:

    PYTHONPATH=$PWD .venv/bin/python scripts/train_model.py --out kvserve/assets/stdlib-coder

What it does, in order (each step is deterministic for a given Python version and seed):

1. corpus: every *.py file under `sysconfig.get_paths()["stdlib"]`, sorted by relative path,
   except those under `site-packages/`, `test/` and `tests/` directories. A file is held out
   when the SHA-256 of its relative path falls in the lowest 5% (`HELD_OUT_PER_MILLE`), so the
   split does not depend on file order or on which other files exist.
2. tokenizer: a byte-level BPE (`tokenizers`, 8,192 entries) trained on the training files only,
   with kvserve's special tokens and ChatML template (`kvserve.tokenizer.train`).
3. model: a Qwen2-architecture decoder (GQA, tied embeddings, RoPE) written here in plain
   PyTorch with the Hugging Face tensor names, so kvserve's loader and transformers both load it.
4. training: AdamW with linear warm-up and cosine decay, fp32, fixed seed, windows of the
   concatenated token stream in a seeded random order; a tqdm bar, a held-out loss every
   `eval_every` steps, a resumable checkpoint, and at the end bf16 safetensors, the loss curve
   (`loss_curve.json`) and its plot.

`--stop-after N` ends the run after N steps of the *same* schedule (the learning rate still
decays over `--steps`), which is what the reproducibility test compares against the recorded
curve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from kvserve.tokenizer import train as tt
from kvserve.eval.heldout import EXCLUDED_DIRS, HELD_OUT_PER_MILLE, corpus_files, stdlib_root
from kvserve.eval.heldout import is_heldout as is_held_out

CURVE_FILE = "loss_curve.json"
CHECKPOINT_FILE = "train_state.pt"
_HF_VERSION = "5.24.0"


@dataclass
class ModelShape:
    """The decoder's shape: about 6M parameters (12 MB at bf16), small enough to train in
    about an hour on two shared CPU cores."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 640
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class TrainConfig:
    """Everything that decides the weights. Recorded in the loss curve file."""

    seed: int = 0
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 220
    warmup_steps: int = 15
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 20
    eval_windows: int = 16
    final_eval_windows: int = 64
    log_every: int = 5
    threads: int = 2
    shape: ModelShape = field(default_factory=ModelShape)


# ------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------

def read_source(root: Path, rel: str) -> str:
    """Decoded as UTF-8 with replacement, so a stray Latin-1 byte cannot stop the run."""
    return (root / rel).read_bytes().decode("utf-8", errors="replace")


@dataclass
class Corpus:
    root: str
    train_files: list[str]
    held_out_files: list[str]
    train_bytes: int
    held_out_bytes: int


def load_corpus(root: Path | None = None) -> tuple[Corpus, list[str], list[str]]:
    """The split's description and the texts of its training and held-out files."""
    root = root or stdlib_root()
    train, held, train_texts, held_texts = [], [], [], []
    for rel in corpus_files(root):
        text = read_source(root, rel)
        if is_held_out(rel):
            held.append(rel)
            held_texts.append(text)
        else:
            train.append(rel)
            train_texts.append(text)
    info = Corpus(str(root), train, held, sum(len(t.encode()) for t in train_texts),
                  sum(len(t.encode()) for t in held_texts))
    return info, train_texts, held_texts


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------

def train_bpe(texts: list[str], out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """A byte-level BPE on the training files, with kvserve's special tokens at ids 0-2 and its
    ChatML template, written in Hugging Face format (tokenizer.json, tokenizer_config.json)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(tt.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    for token_id, token in enumerate(tt.SPECIAL_TOKENS):
        if backend.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} got id {backend.token_to_id(token)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    tt.write_tokenizer_config(out_dir, model_max_length)


def encode_stream(tokenizer_dir: Path, texts: list[str]) -> np.ndarray:
    """All texts' tokens, each file followed by <|endoftext|>, as one uint16 stream."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([tt.BOS_TOKEN_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# ------------------------------------------------------------------------------------------
# Model: Qwen2 (q/k/v biases, RMSNorm, SwiGLU, RoPE, GQA, tied embeddings), HF tensor names
# ------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope_tables(shape: ModelShape, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of HF's rotate-half RoPE for positions 0..length-1, shape (length, head_dim)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        d = s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * d, bias=True)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * d, bias=True)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * d, bias=True)
        self.o_proj = nn.Linear(s.num_attention_heads * d, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s, d = self.s, self.s.head_dim
        q = self.q_proj(x).view(b, t, s.num_attention_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = s.num_attention_heads // s.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Qwen2LM(nn.Module):
    """`model.*` holds the HF names; the LM head is the (tied) embedding."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.shape = s
        self.model = Backbone(s)
        cos, sin = rope_tables(s, s.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """N(0, std) matrices, residual outputs scaled by 1/sqrt(2 * layers) (GPT-2's rule, it
        keeps early training stable), zero biases, unit norms; drawn in module order."""
        gen = torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * self.shape.num_hidden_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    scale = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a (batch, seq_len + 1) block of tokens."""
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))


def hf_config(s: ModelShape, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json as transformers 5.24 writes it for Qwen2ForCausalLM."""
    return dict(sorted({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": tt.BOS_TOKEN_ID, "eos_token_id": tt.EOS_TOKEN_ID, "dtype": dtype,
        "hidden_act": "silu", "hidden_size": s.hidden_size, "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size, "layer_types": ["full_attention"] * s.num_hidden_layers,
        "max_position_embeddings": s.max_position_embeddings,
        "max_window_layers": s.num_hidden_layers, "model_type": "qwen2",
        "num_attention_heads": s.num_attention_heads, "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads, "pad_token_id": tt.BOS_TOKEN_ID,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_parameters": {"rope_theta": s.rope_theta, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": True, "transformers_version": _HF_VERSION,
        "use_cache": True, "use_sliding_window": False, "vocab_size": s.vocab_size,
    }.items()))


def hf_state_dict(model: Qwen2LM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights under their HF names (no lm_head: it is tied), cast to `dtype`."""
    return {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}


def load_hf_weights(model_dir: Path) -> Qwen2LM:
    """The committed checkpoint back in the training model (fp32), for evaluation in tests."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    s = ModelShape(**{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "max_position_embeddings",
                                          "rms_norm_eps")},
                   rope_theta=cfg["rope_parameters"]["rope_theta"])
    model = Qwen2LM(s)
    weights = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    model.load_state_dict(weights)
    return model.eval()


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows (the last token of one is the first of the
    next's target), as an (n, seq_len + 1) int64 tensor."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


def batch_order(num_windows: int, cfg: TrainConfig, steps: int) -> torch.Tensor:
    """Window indices for every step: seeded permutations, one per epoch, concatenated."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    need = steps * cfg.batch_size
    perms = [torch.randperm(num_windows, generator=gen)
             for _ in range(math.ceil(need / num_windows))]
    return torch.cat(perms)[:need].view(steps, cfg.batch_size)


@torch.no_grad()
def evaluate(model: Qwen2LM, data: torch.Tensor, batch_size: int = 16) -> float:
    """Mean token loss over all windows of `data`."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        chunk = data[i:i + batch_size]
        total += model.loss(chunk).item() * chunk.numel()
        count += chunk.numel()
    model.train()
    return total / count


def eval_subset(held: torch.Tensor, count: int) -> torch.Tensor:
    """`count` evenly spaced held-out windows: the periodic estimate."""
    if len(held) <= count:
        return held
    idx = torch.linspace(0, len(held) - 1, count).round().long()
    return held[idx]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; biases, norms stay undecayed."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def train(cfg: TrainConfig, out: Path, work: Path, tokenizer_dir: Path | None,
          stop_after: int | None, resume: bool) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    corpus, train_texts, held_texts = load_corpus()
    print(f"corpus: {len(corpus.train_files)} train files ({corpus.train_bytes:,} bytes), "
          f"{len(corpus.held_out_files)} held-out ({corpus.held_out_bytes:,} bytes) from "
          f"{corpus.root}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        t0 = time.time()
        train_bpe(train_texts, out, cfg.shape.vocab_size, cfg.shape.max_position_embeddings)
        print(f"tokenizer trained in {time.time() - t0:.1f} s", flush=True)
        tokenizer_dir = out
    train_stream = encode_stream(tokenizer_dir, train_texts)
    held_stream = encode_stream(tokenizer_dir, held_texts)
    print(f"tokens: {len(train_stream):,} train, {len(held_stream):,} held-out", flush=True)
    train_w, held_w = windows(train_stream, cfg.seq_len), windows(held_stream, cfg.seq_len)
    held_eval = eval_subset(held_w, cfg.eval_windows)
    order = batch_order(len(train_w), cfg, cfg.steps)

    model = Qwen2LM(cfg.shape)
    model.init_weights(cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=False, foreach=True)
    curve: list[dict[str, Any]] = []
    step0, elapsed0 = 0, 0.0
    ckpt = work / CHECKPOINT_FILE
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step0, curve, elapsed0 = state["step"], state["curve"], state["elapsed"]
        print(f"resumed at step {step0}", flush=True)
    last = min(cfg.steps, stop_after) if stop_after else cfg.steps
    model.train()
    t_loop = time.time()
    bar = tqdm(range(step0, last), initial=step0, total=last, desc="train", dynamic_ncols=True,
               mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = model.loss(train_w[order[step]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        done = step + 1
        row: dict[str, Any] | None = None
        if done % cfg.log_every == 0 or done == 1:
            row = {"step": done, "tokens": done * cfg.batch_size * cfg.seq_len,
                   "train_loss": round(loss.item(), 5), "lr": lr_at(step, cfg)}
        if done % cfg.eval_every == 0 or done == cfg.steps:
            row = row or {"step": done, "tokens": done * cfg.batch_size * cfg.seq_len,
                          "train_loss": round(loss.item(), 5), "lr": lr_at(step, cfg)}
            row["held_out_loss"] = round(evaluate(model, held_eval), 5)
            tqdm.write(f"step {done}: train {row['train_loss']:.4f}, held-out "
                       f"{row['held_out_loss']:.4f}")
        if row is not None:
            curve.append(row)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if done % cfg.eval_every == 0 and done < last:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done,
                        "curve": curve, "elapsed": elapsed0 + time.time() - t_loop}, ckpt)
    bar.close()
    train_s = elapsed0 + time.time() - t_loop
    steps_run = last
    tokens_seen = steps_run * cfg.batch_size * cfg.seq_len
    summary: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "config": asdict(cfg), "parameters": n_params,
        "corpus": {"root": corpus.root, "excluded_dirs": sorted(EXCLUDED_DIRS),
                   "train_files": len(corpus.train_files),
                   "held_out_files": len(corpus.held_out_files),
                   "train_bytes": corpus.train_bytes, "held_out_bytes": corpus.held_out_bytes,
                   "train_tokens": int(len(train_stream)),
                   "held_out_tokens": int(len(held_stream))},
        "steps": steps_run, "tokens_seen": tokens_seen,
        "train_seconds": round(train_s, 1), "tokens_per_second": round(tokens_seen / train_s, 1),
        "curve": curve,
    }
    if steps_run == cfg.steps:  # the full run: final numbers, weights, plot
        tail = [r["train_loss"] for r in curve if r["step"] > cfg.steps - 10 * cfg.log_every]
        final_train = float(np.mean(tail))
        t0 = time.time()
        final_eval = eval_subset(held_w, cfg.final_eval_windows)
        final_held = evaluate(model, final_eval)
        summary.update(final_train_loss=round(final_train, 4),
                       final_train_ppl=round(math.exp(final_train), 2),
                       final_held_out_loss=round(final_held, 4),
                       final_held_out_ppl=round(math.exp(final_held), 2),
                       final_held_out_tokens=int(final_eval[:, 1:].numel()))
        print(f"final: train {final_train:.4f} (ppl {math.exp(final_train):.2f}), held-out "
              f"{final_held:.4f} (ppl {math.exp(final_held):.2f}) over {final_eval[:, 1:].numel():,} "
              f"tokens in {time.time() - t0:.0f} s", flush=True)
        write_checkpoint(model, out)
    summary["total_seconds"] = round(time.time() - t_start, 1)
    curve_path = out / CURVE_FILE if steps_run == cfg.steps else work / CURVE_FILE
    curve_path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {curve_path}", flush=True)
    return summary


def write_checkpoint(model: Qwen2LM, out: Path) -> None:
    """bf16 safetensors, config.json, generation_config.json (the tokenizer is already there)."""
    save_file(hf_state_dict(model, torch.bfloat16), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.shape), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tt.BOS_TOKEN_ID, "eos_token_id": [tt.EOS_TOKEN_ID, tt.BOS_TOKEN_ID],
        "pad_token_id": tt.BOS_TOKEN_ID, "do_sample": True, "temperature": 0.7, "top_p": 0.95,
        "transformers_version": _HF_VERSION}, indent=2, sort_keys=True) + "\n")


REPRODUCE = ("PYTHONPATH=$PWD .venv/bin/python scripts/train_model.py "
             "--out kvserve/assets/stdlib-coder")


def write_model_card(out: Path, summary: dict[str, Any]) -> None:
    """README.md beside the weights: what the model is, what it saw, how well it does, and
    the one command that makes it again."""
    c, corpus = summary["config"], summary["corpus"]
    s = c["shape"]
    size = (out / "model.safetensors").stat().st_size
    held = [r for r in summary["curve"] if "held_out_loss" in r]
    rows = "\n".join(f"| {r['step']} | {r['tokens']:,} | {r['train_loss']:.3f} | "
                     f"{r['held_out_loss']:.3f} |" for r in held)
    text = f"""# stdlib-coder

kvserve's embedded default model: a {summary['parameters'] / 1e6:.1f}M-parameter Qwen2-architecture
decoder trained from scratch, on two shared CPU cores, on the source of the Python standard
library. It exists so that `LLM()` and `make demo` run weights that were trained rather than
drawn at random, with no download. It is a demonstration model and a very undertrained one (the
whole run fits in well under an hour of two shared CPU cores): it has learnt the commonest
tokens of Python and some local structure, so its completions look like Python but are seldom
valid code. Its held-out perplexity is the figure to compare, not its prose.

| | |
| --- | --- |
| architecture | `Qwen2ForCausalLM`: {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, \
intermediate {s['intermediate_size']} (SwiGLU), {s['num_attention_heads']} query heads / \
{s['num_key_value_heads']} KV heads (GQA), head dim {s['hidden_size'] // s['num_attention_heads']}, \
RoPE theta {s['rope_theta']:g}, tied embeddings |
| parameters | {summary['parameters']:,} ({size / 1e6:.1f} MB of bf16 safetensors) |
| context | {s['max_position_embeddings']:,} positions in config.json; trained on \
{c['seq_len']}-token windows, so it is at its best within {c['seq_len']} tokens |
| tokenizer | byte-level BPE, {s['vocab_size']:,} entries, trained on the training files; \
special tokens `<|endoftext|>` (0, also padding and the file separator), `<|im_start|>` (1), \
`<|im_end|>` (2, EOS); ChatML chat template (kvserve's `tokenizer_train.CHATML_TEMPLATE`) |
| corpus | Python {summary['python']} standard library (`{corpus['root']}`): every `*.py` file \
except under `{"/`, `".join(corpus['excluded_dirs'])}/` directories |
| split | held out: files whose SHA-256 of the relative path mod 1000 is < {HELD_OUT_PER_MILLE} \
({corpus['held_out_files']} files, {corpus['held_out_bytes']:,} bytes, \
{corpus['held_out_tokens']:,} tokens); train: {corpus['train_files']} files, \
{corpus['train_bytes']:,} bytes, {corpus['train_tokens']:,} tokens |
| training | {summary['steps']} steps of {c['batch_size']} x {c['seq_len']} tokens = \
**{summary['tokens_seen']:,} tokens seen** ({summary['tokens_seen'] / corpus['train_tokens']:.2f} \
epochs); AdamW (betas 0.9/0.95, weight decay {c['weight_decay']}), peak LR {c['lr']:g}, \
{c['warmup_steps']} warm-up steps, cosine to {c['min_lr_ratio']:g}x; grad clip \
{c['grad_clip']}; fp32; seed {c['seed']}; torch {summary['torch']}, {c['threads']} threads |
| wall time | {summary['train_seconds'] / 60:.1f} min of training \
({summary['tokens_per_second']:.0f} tokens/s on 2 CPU cores shared with other jobs), \
{summary['total_seconds'] / 60:.1f} min in all |
| final train loss | {summary['final_train_loss']:.3f} nats/token (perplexity \
{summary['final_train_ppl']:.1f}; mean of the last 10 logged batches) |
| final held-out loss | **{summary['final_held_out_loss']:.3f}** nats/token (perplexity \
**{summary['final_held_out_ppl']:.1f}**) on {summary['final_held_out_tokens']:,} held-out \
tokens |

Held-out loss during training (the full curve is `loss_curve.json`; the plot is
`docs/img/train_loss.png` in the kvserve repository):

| step | tokens seen | train loss (one batch) | held-out loss ({c['eval_windows']} windows) |
| --- | --- | --- | --- |
{rows}

## Reproduce

From the root of a kvserve checkout, on Python {summary['python']} (another version's standard
library is another corpus):

```bash
{REPRODUCE}
```

The run is deterministic for a given Python, torch and thread count: the file order is sorted,
the split is a hash of each path, the tokenizer trainer is deterministic, and the weights and
the batch order come from seeded generators. `tests/test_trained_model.py` re-runs its first
steps (`--stop-after`) and checks the train losses against `loss_curve.json` within 2%. An
interrupted run continues with `--resume` from the checkpoint in `--work` (default `out/train`).
"""
    (out / "README.md").write_text(text)


def plot_curve(curve_file: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(curve_file.read_text())
    rows = data["curve"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["train_loss"] for r in rows],
            label="train (one batch)", lw=1, alpha=0.8)
    held = [r for r in rows if "held_out_loss" in r]
    ax.plot([r["tokens"] / 1e6 for r in held], [r["held_out_loss"] for r in held], "o-",
            label="held-out (5% of files)", ms=3)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=max(0.0, min(r["train_loss"] for r in rows) - 0.3), top=min(9.5, max(r["train_loss"] for r in rows) + 0.2))
    ax.set_title(f"stdlib-coder: {data['parameters'] / 1e6:.1f}M params on the Python "
                 f"{data['python']} stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = TrainConfig()
    p.add_argument("--out", type=Path, default=Path("kvserve/assets/stdlib-coder"))
    p.add_argument("--work", type=Path, default=Path("out/train"),
                   help="resumable checkpoint and partial curves (not committed)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="use this directory's tokenizer.json instead of training one")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after N steps of the same schedule (a shortened run)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--plot", default="docs/img/train_loss.png",
                   help="where the loss-curve plot goes ('' for none)")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the model card and the plot from --out's loss_curve.json")
    args = p.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, seq_len=args.seq_len, batch_size=args.batch_size,
                      steps=args.steps, lr=args.lr, eval_every=args.eval_every,
                      threads=args.threads)
    if args.report_only:
        summary = json.loads((args.out / CURVE_FILE).read_text())
    else:
        summary = train(cfg, args.out, args.work, args.tokenizer, args.stop_after, args.resume)
    if summary["steps"] == summary["config"]["steps"]:
        write_model_card(args.out, summary)
        print(f"wrote {args.out / 'README.md'}")
        if args.plot:
            plot_curve(args.out / CURVE_FILE, Path(args.plot))
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
