"""GPU benchmark (issue #7, acceptance 2): the figures docs/gpu.md's targets name, kvserve
against transformers on one GPU, one table (random bf16 checkpoints made by make_model):

  0. device-to-device copy bandwidth (read + write bytes / time), the roofline's denominator;
  1. Qwen3-0.6B shape: output tokens / wall time of one `generate` of 256 requests, prompt and
     output lengths uniform in [100, 1024] (nano-vllm's draw: random.seed(0), every prompt's
     tokens, then the output lengths), greedy, EOS ignored;
  2. Qwen2.5-7B shape: batch-1 decode tok/s (128-token prompt, 128 new, first to last token)
     as a fraction of the HBM roofline: the copy bandwidth over the bytes a step reads (every
     weight matrix but the input embedding, of which it reads one row, and the KV);
  3. transformers `generate` at batch 1, its default cache and cache_implementation="static".

    .venv/bin/python benchmarks/bench_gpu.py --out /tmp/bench_gpu.json     # one H200, < 8 min
    .venv/bin/python benchmarks/bench_gpu.py --smoke --out /tmp/smoke.json  # tiny, on the CPU

`--smoke` runs every code path with tiny models on the CPU (kvserve's torch backend,
transformers eager): it checks the script, not the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvserve import LLM, SamplingParams
from kvserve.model_loader.make_model import make_model


@dataclass
class Plan:
    """Every size the script uses; `smoke()` shrinks them all."""

    device: str = "cuda"
    small_arch: str = "qwen3"
    small_size: str = "qwen3-0.6b"
    big_arch: str = "qwen2"
    big_size: str = "qwen2.5-7b"
    num_requests: int = 256
    len_range: tuple[int, int] = (100, 1024)
    prompt_token_max: int = 10000
    decode_prompt: int = 128
    decode_new: int = 128
    max_model_len_small: int = 2048
    max_model_len_big: int = 512
    copy_bytes: int = 1 << 30
    # Each engine's share of the GPU (it is freed before the next part): the 0.6B run peaks near
    # 32 GB of KV, the 7B part needs 15 GB of weights and little KV.
    gpu_memory_utilization: float = 0.4
    attention_backend: str = "auto"  # triton on cuda, torch on cpu

    @classmethod
    def smoke(cls) -> "Plan":
        return cls(device="cpu", small_arch="qwen3", small_size="tiny", big_arch="qwen2",
                   big_size="tiny", num_requests=8, len_range=(4, 24), prompt_token_max=2000,
                   decode_prompt=16, decode_new=8, max_model_len_small=64,
                   max_model_len_big=160, copy_bytes=1 << 22)


@dataclass
class Results:
    device: str = ""  # the GPU's name, or "cpu"
    device_type: str = "cpu"  # "cuda" or "cpu"
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(plan: Plan) -> float:
    """Bytes read + written per second by a large device-to-device copy (best of 10)."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync(plan.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(plan.device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * plan.copy_bytes / best


def workload(plan: Plan) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw: random.seed(0), every prompt (length, then its tokens), then every
    output length."""
    random.seed(0)
    lo, hi = plan.len_range
    prompts = [[random.randint(0, plan.prompt_token_max) for _ in range(random.randint(lo, hi))]
               for _ in range(plan.num_requests)]
    outputs = [random.randint(lo, hi) for _ in range(plan.num_requests)]
    return prompts, outputs


def make_checkpoints(plan: Plan, workdir: Path) -> dict[str, Path]:
    """Random bf16 checkpoints (weights drawn on the GPU when there is one) and a small
    tokenizer: the engine only needs one for EOS ids, all prompts here are token ids."""
    out = {}
    for name, arch, size in (("small", plan.small_arch, plan.small_size),
                             ("big", plan.big_arch, plan.big_size)):
        path = workdir / f"{arch}-{size}-bf16"
        if not (path / "model.safetensors").is_file():
            t0 = time.perf_counter()
            make_model(path, arch=arch, size=size, seed=0, dtype="bfloat16",
                       with_tokenizer=False, device=plan.device)
            print(f"made {path} in {time.perf_counter() - t0:.1f} s", flush=True)
        out[name] = path
    tok = workdir / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        make_model(tok, arch="qwen2", size="tiny", seed=0)
    out["tokenizer"] = tok
    return out


def engine(plan: Plan, path: Path, tokenizer: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(path), tokenizer=str(tokenizer), dtype="bfloat16", device=plan.device,
               attention_backend=plan.attention_backend, seed=0, **kwargs,
               **({"gpu_memory_utilization": plan.gpu_memory_utilization}
                  if plan.device == "cuda" else {"kv_cache_memory_bytes": 256 << 20}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)


def decode_rate(outputs: list[Any]) -> float:
    """Tokens after the first, over the time from the last first token to the last token."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.last_token_time for o in outputs)
    return tokens / max(end - start, 1e-9)


def guarded(results: Results, key: str, fn: Callable[[], Any]) -> Any:
    """Run one part; a failure is recorded (and printed) instead of ending the script."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark part failing must not hide the others
        results.errors[key] = f"{type(e).__name__}: {e}"
        print(f"[{key}] FAILED: {results.errors[key]}", flush=True)
        return None
    finally:  # the part's engine or model is gone with its frame: give its memory back
        gc.collect()
        left = ""
        if results.device_type == "cuda":
            sync("cuda")
            torch.cuda.empty_cache()
            left = f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated"
        print(f"[{key}] {time.perf_counter() - t0:.1f} s{left}", flush=True)
    return value


# -- kvserve -------------------------------------------------------------------------------------
def kvserve_throughput(plan: Plan, ckpt: dict[str, Path]) -> dict[str, Any]:
    prompts, out_lens = workload(plan)
    llm = engine(plan, ckpt["small"], ckpt["tokenizer"], max_model_len=plan.max_model_len_small,
                 max_num_seqs=256, enable_prefix_caching=False)
    # Warm-up: more prompt tokens than one step takes, so that steps mixing a prefill chunk
    # with decodes (the eager path) run too, not only graph replays.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:24]], greedy(16), use_tqdm=False)
    sync(plan.device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(n) for n in out_lens], use_tqdm=False)
    sync(plan.device)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    del llm
    return {"prompt_tokens": sum(map(len, prompts)), "output_tokens": produced,
            "seconds": wall, "output_tok_s": produced / wall}


def weights_read_per_step(llm: LLM) -> int:
    """Bytes of every parameter a decode step reads in full (the input embedding is a lookup)."""
    model = llm.engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the embedding table is only indexed
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def kvserve_decode(plan: Plan, ckpt: dict[str, Path], bandwidth: float) -> dict[str, Any]:
    llm = engine(plan, ckpt["big"], ckpt["tokenizer"], max_model_len=plan.max_model_len_big,
                 max_num_seqs=2)
    rng = random.Random(1)

    def prompt() -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randint(0, plan.prompt_token_max)
                                     for _ in range(plan.decode_prompt)]}

    llm.generate([prompt() for _ in range(2)], greedy(8), use_tqdm=False)  # warm-up
    res: dict[str, Any] = {"decode_tok_s_b1": decode_rate(llm.generate(
        [prompt()], greedy(plan.decode_new), use_tqdm=False))}
    weights = weights_read_per_step(llm)
    kv = llm.engine.kv_spec.bytes_per_token * (plan.decode_prompt + plan.decode_new // 2)
    res["bytes_per_step"] = weights + kv
    res["roofline_tok_s"] = bandwidth / (weights + kv)
    res["roofline_fraction_b1"] = res["decode_tok_s_b1"] / res["roofline_tok_s"]
    del llm
    return res


# -- transformers --------------------------------------------------------------------------------
def hf_model(plan: Plan, path: Path) -> Any:
    import transformers

    # No device_map: that needs `accelerate`, which the GPU machine may not have.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.to(plan.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_decode(plan: Plan, ckpt: dict[str, Path]) -> dict[str, Any]:
    """Batch-1 decode tokens/s of `generate`: the time of a whole generate less a prefill."""
    model = hf_model(plan, ckpt["big"])
    gen = torch.Generator().manual_seed(2)

    def run(warmup_tokens: int, **kwargs: Any) -> float:
        ids = torch.randint(0, plan.prompt_token_max, (1, plan.decode_prompt),
                            generator=gen).to(plan.device)
        common = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                      **kwargs)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=warmup_tokens, **common)  # warm-up (compile)
            sync(plan.device)
            t0 = time.perf_counter()
            model(ids)  # the prefill alone, subtracted below: decode tokens/s
            sync(plan.device)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=plan.decode_new, **common)
            sync(plan.device)
            t2 = time.perf_counter()
        return (plan.decode_new - 1) / max((t2 - t1) - (t1 - t0), 1e-9)

    res: dict[str, Any] = {"decode_tok_s_b1": run(4)}
    try:
        # The static cache is sized by prompt + max_new_tokens: warm up with the same length,
        # or the timed run would compile again.
        res["decode_tok_s_b1_static"] = run(plan.decode_new, cache_implementation="static")
    except Exception as e:  # noqa: BLE001 - compile may be unavailable (e.g. no C compiler)
        res["decode_tok_s_b1_static_error"] = f"{type(e).__name__}: {e}"
    return res  # the model goes with this frame, before guarded() frees the cache


# -- report --------------------------------------------------------------------------------------
def table(plan: Plan, r: Results) -> str:
    f = r.figures
    kv1, kv2, hf2 = (f.get(k) or {} for k in ("kvserve_throughput", "kvserve_7b", "hf_7b"))
    bw = f.get("copy_bandwidth_Bps")

    def num(x: Any, fmt: str = "{:,.0f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    roof = kv2.get("roofline_tok_s")
    hf_static = hf2.get("decode_tok_s_b1_static")
    rows = [
        ("copy bandwidth (read + write)", num(bw and bw / 1e9, "{:,.0f} GB/s"), ""),
        (f"(1) {plan.small_size}, {plan.num_requests} req, output tok/s",
         num(kv1.get("output_tok_s")), ""),
        (f"(2) {plan.big_size}, batch 1 decode tok/s", num(kv2.get("decode_tok_s_b1"), "{:,.1f}"),
         f"{num(hf2.get('decode_tok_s_b1'), '{:,.1f}')} default, "
         f"{num(hf_static, '{:,.1f}')} static+compiled"),
        ("(2) batch 1 fraction of HBM roofline",
         num(kv2.get("roofline_fraction_b1"), "{:.0%}") + f" of {num(roof, '{:,.0f}')} tok/s",
         num(hf_static and roof and hf_static / roof, "{:.0%}") + " (static)"),
    ]
    lines = [f"{a:<44} | {b:>24} | {c}" for a, b, c in [("figure", "kvserve", "transformers"),
                                                          *rows]]
    if r.errors:
        lines.append("errors: " + "; ".join(f"{k}: {v}" for k, v in r.errors.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models on the CPU: checks every code path in seconds")
    parser.add_argument("--workdir", default="/tmp/kvserve-bench-gpu",
                        help="checkpoints are made here once and reused")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"),
                        default="auto", help="with --smoke, triton runs Triton's interpreter "
                        "on the CPU (slower: about a minute)")
    args = parser.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan()
    plan.attention_backend = args.attention_backend
    if plan.device == "cpu" and plan.attention_backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) / ("smoke" if args.smoke else "full")
    workdir.mkdir(parents=True, exist_ok=True)
    results = Results(device=torch.cuda.get_device_name() if plan.device == "cuda" else "cpu",
                      device_type=plan.device)
    start = time.perf_counter()
    ckpt = guarded(results, "checkpoints", lambda: make_checkpoints(plan, workdir))
    if ckpt is None:
        print(table(plan, results))
        return 1
    f = results.figures
    f["copy_bandwidth_Bps"] = guarded(results, "copy_bandwidth", lambda: copy_bandwidth(plan))
    f["kvserve_throughput"] = guarded(results, "kvserve_throughput",
                                      lambda: kvserve_throughput(plan, ckpt))
    f["kvserve_7b"] = guarded(results, "kvserve_7b", lambda: kvserve_decode(
        plan, ckpt, f["copy_bandwidth_Bps"] or float("nan")))
    if not args.skip_transformers:
        f["hf_7b"] = guarded(results, "hf_7b", lambda: hf_decode(plan, ckpt))
    f["total_seconds"] = time.perf_counter() - start
    f["plan"] = asdict(plan)
    report = table(plan, results)
    print(report)
    Path(args.out).write_text(json.dumps({**asdict(results), "table": report}, indent=2,
                                         default=str) + "\n", encoding="utf-8")
    return 0 if not results.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
