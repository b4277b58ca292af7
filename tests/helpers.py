"""Test helpers: drive the engine step by step with the invariant check after every step."""

from __future__ import annotations

import random

from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams


def generate_checked(llm, prompts, params, max_steps: int = 100_000) -> list[RequestOutput]:
    """Like LLM.generate (one SamplingParams, or one per prompt), but runs check_invariants()
    after every step and checks that every KV block is back in the pool at the end."""
    engine = llm.engine
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    else:
        raise AssertionError("the engine did not finish")
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return [done[i] for i in ids]


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' own greedy continuations (the independent reference), one prompt at a time
    so that no padding is involved, EOS disabled."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def kv_bytes_per_token(model_dir, dtype_bytes: int = 4) -> int:
    """KV bytes per token computed from config.json by the textbook formula (not kvserve's)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def pool_over(caches, block_size: int | None = None, windows: tuple = ()):
    """A KV tensor pool over hand-made per-layer (k, v) tensors [blocks, block_size, Hkv, D];
    `windows` gives each layer's sliding window (None = full attention)."""
    from kvserve.kv.spec import KVStorage, decoder_kv_spec
    from kvserve.kv.tensors import KVTensorPool

    k0 = caches[0][0]
    spec = decoder_kv_spec(len(caches), k0.shape[2], k0.shape[3], KVStorage("fp32"),
                           block_size or k0.shape[1], tuple(windows))
    return KVTensorPool.wrap(spec, caches)


def save_random_checkpoint(config, out, seed: int = 0, perturb_norms: bool = False):
    """A random-weight checkpoint of a transformers config, written by transformers' own
    save_pretrained, with the project's small tokenizer (vocabulary 512). `perturb_norms` moves
    every norm weight off its initial value (1, or 0 for Gemma's 1 + w), so that a wrong
    mapping of a norm cannot hide."""
    import torch
    import transformers

    from kvserve.tokenizer.train import train_tokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform logits and fragile greedy ties; a wider
    # spread makes the argmax well separated, so a parity failure means a real difference.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif perturb_norms and "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    train_tokenizer(out, 512)
    return out


def first_token_logits(llm, batches: list[list[list[int]]]
                       ) -> dict[tuple[int, ...], "torch.Tensor"]:
    """Each batch of prompts generated for one token in turn; by prompt, the logits its first
    token was sampled from (the batched paged path's)."""
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    captured: dict[tuple[int, ...], torch.Tensor] = {}
    original = runner.forward

    def spy(seqs):
        out = original(seqs)
        prompts = {r.request_id: r.prompt_token_ids for r in scheduler.running}
        for j, i in enumerate(out.sampled):
            captured[tuple(prompts[seqs[i].request_id])] = out.logits[j].clone()
        return out

    runner.forward = spy
    try:
        for prompts in batches:
            generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        runner.forward = original
    return captured


def record_decode_steps(llm, fast: bool = True) -> dict:
    """On `llm`'s model (which must have a one-call `decode_step`): record the rows of each
    step the one-call path ran ("rows"), the steps it left to the layer path ("left") and
    every logits tensor ("logits"); `fast=False`: the path taken away, logits still kept."""
    model = llm.engine.runner.model
    assert model.decode_step is not None, "the one-call decode was not set up"
    seen = {"rows": [], "left": 0, "logits": []}
    if fast:
        inner, asked = model.decode_step.run, model.decode_step.serves

        def served(rows):
            ok = asked(rows)
            seen["left"] += not ok
            return ok

        model.decode_step.serves = served

        def counted(hidden, *args):
            result = inner(hidden, *args)
            if result is None:
                seen["left"] += 1
            else:
                seen["rows"].append(hidden.shape[0])
            return result

        model.decode_step.run = counted
    else:
        model.decode_step = None
    logits = model.compute_logits

    def recorded(hidden):
        out = logits(hidden)
        seen["logits"].append(out.clone())
        return out

    model.compute_logits = recorded
    return seen


def greedy_ids(llm, prompts: list[list[int]], max_tokens) -> list[list[int]]:
    """Greedy token ids of each prompt (ids), with its own max_tokens, ignoring EOS."""
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
                             for t in max_tokens])
    return [o.outputs[0].token_ids for o in outs]
