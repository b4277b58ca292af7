"""GPU benchmark (issue #7, acceptance 2): kvserve against transformers on one GPU, one table.

    .venv/bin/python benchmarks/bench_gpu.py --out /tmp/bench_gpu.json     # one H200, < 8 min
    .venv/bin/python benchmarks/bench_gpu.py --smoke --out /tmp/smoke.json  # every code path,
                                                                           # tiny shapes, CPU

Parts (random-weight checkpoints made locally with `kvserve.model_loader.make_model`, bf16):
  0. device-to-device copy bandwidth (read + write bytes / time), the roofline's denominator;
  1. Qwen3-0.6B architecture: 256 requests, prompt and output lengths uniform in [100, 1024]
     (python random.seed(0), nano-vllm's draw order: every prompt's tokens, then the output
     lengths; 142,827 prompt / 133,966 output tokens), greedy, EOS ignored: output tokens/s;
  2. Qwen2.5-7B architecture: decode tokens/s at batch 1 and batch 64 (128-token prompts, 128
     new tokens), and batch 1 as a fraction of the HBM roofline = bytes read per decode step
     (every weight matrix except the input-embedding table, of which a step reads one row, plus
     the KV read at the mean context) / the copy bandwidth of part 0;
  3. TTFT of a 2K and an 8K prompt on the 7B model, cold and with the prefix cached;
  4. transformers on the same GPU: (1) with its continuous batching (`generate_batch`) on a
     budgeted subset (the first `--hf-requests` requests, max_new_tokens `--hf-max-new`; the
     full run takes ~225 s there), (2) `generate` at batch 1 with the default cache, batch 1
     with cache_implementation="static" (compiled decode), and batch 64.

Decode tokens/s is measured from each request's first to last token (so prefill is excluded);
kvserve's whole-run throughput of part 1 is output tokens / wall time of `generate`.
`--smoke` runs the same code with tiny models on the CPU (kvserve's torch backend, transformers
eager) in well under a minute: it checks the script, not the figures.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model_loader.make_model import make_model  # noqa: E402


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
    big_batch: int = 64
    ttft_lens: tuple[int, ...] = (2048, 8192)
    max_model_len_small: int = 2048
    max_model_len_big: int = 8448
    hf_requests: int = 64
    hf_max_new: int = 128
    copy_bytes: int = 1 << 30
    # Each engine's share of the GPU (it is freed before the next part): the 0.6B run peaks near
    # 32 GB of KV, the 7B parts need 15 GB of weights and little KV.
    gpu_memory_utilization: float = 0.4
    attention_backend: str = "auto"  # triton on cuda, torch on cpu

    @classmethod
    def smoke(cls) -> "Plan":
        return cls(device="cpu", small_arch="qwen3", small_size="tiny", big_arch="qwen2",
                   big_size="tiny", num_requests=8, len_range=(4, 24), prompt_token_max=2000,
                   decode_prompt=16, decode_new=8, big_batch=4, ttft_lens=(64, 128),
                   max_model_len_small=64, max_model_len_big=160, hf_requests=4, hf_max_new=8,
                   copy_bytes=1 << 22)


@dataclass
class Results:
    device: str = ""  # the GPU's name, or "cpu"
    device_type: str = "cpu"  # "cuda" or "cpu"
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


# -- helpers -------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


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
    finally:
        free_memory(results.device_type)
        left = (f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated"
                if results.device_type == "cuda" else "")
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


def kvserve_decode_and_ttft(plan: Plan, ckpt: dict[str, Path], bandwidth: float
                            ) -> dict[str, Any]:
    llm = engine(plan, ckpt["big"], ckpt["tokenizer"], max_model_len=plan.max_model_len_big,
                 max_num_seqs=plan.big_batch)
    rng = random.Random(1)

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randint(0, plan.prompt_token_max) for _ in range(n)]}

    llm.generate([prompt(plan.decode_prompt) for _ in range(2)], greedy(8), use_tqdm=False)
    res: dict[str, Any] = {}
    for batch in (1, plan.big_batch):
        outs = llm.generate([prompt(plan.decode_prompt) for _ in range(batch)],
                            greedy(plan.decode_new), use_tqdm=False)
        res[f"decode_tok_s_b{batch}"] = decode_rate(outs)
    weights = weights_read_per_step(llm)
    kv = llm.engine.kv_spec.bytes_per_token * (plan.decode_prompt + plan.decode_new // 2)
    res["bytes_per_step"] = weights + kv
    res["roofline_tok_s"] = bandwidth / (weights + kv)
    res["roofline_fraction_b1"] = res["decode_tok_s_b1"] / res["roofline_tok_s"]
    # TTFT: a warm-up long prompt compiles nothing new but fills the allocator's pools.
    llm.generate([prompt(plan.ttft_lens[0])], greedy(1), use_tqdm=False)
    for n in plan.ttft_lens:
        p = prompt(n)
        for label in ("cold", "cached"):
            sync(plan.device)
            t0 = time.perf_counter()
            out = llm.generate([p], greedy(1), use_tqdm=False)[0]
            sync(plan.device)
            res[f"ttft_{n}_{label}_ms"] = 1000 * (time.perf_counter() - t0)
            res[f"ttft_{n}_{label}_cached_tokens"] = out.num_cached_tokens
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


def hf_throughput(plan: Plan, ckpt: dict[str, Path]) -> dict[str, Any]:
    """transformers continuous batching over the budgeted subset (see the module docstring)."""
    from transformers import GenerationConfig

    prompts, _ = workload(plan)
    subset = prompts[: plan.hf_requests]
    model = hf_model(plan, ckpt["small"])
    config = GenerationConfig(max_new_tokens=plan.hf_max_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    extra: dict[str, Any] = {}
    if plan.device == "cpu":  # smoke: a small cache (it would size itself from host RAM)
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            extra["continuous_batching_config"] = ContinuousBatchingConfig(
                num_blocks=16, max_batch_tokens=128)
        except ImportError:  # older transformers: no such config, defaults it is
            pass
    model.generate_batch(inputs=subset[:2], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0), **extra)
    sync(plan.device)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=subset, generation_config=config, **extra)
    sync(plan.device)
    wall = time.perf_counter() - t0
    produced = sum(len(o.generated_tokens) for o in outs.values())
    del model
    return {"requests": len(subset), "max_new_tokens": plan.hf_max_new,
            "output_tokens": produced, "seconds": wall, "output_tok_s": produced / wall}


def hf_decode(plan: Plan, ckpt: dict[str, Path]) -> dict[str, Any]:
    model = hf_model(plan, ckpt["big"])
    gen = torch.Generator().manual_seed(2)
    res: dict[str, Any] = {}

    def run(batch: int, warmup_tokens: int, **kwargs: Any) -> float:
        ids = torch.randint(0, plan.prompt_token_max, (batch, plan.decode_prompt),
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
        return batch * (plan.decode_new - 1) / max((t2 - t1) - (t1 - t0), 1e-9)

    res["decode_tok_s_b1"] = run(1, 4)
    try:
        # The static cache is sized by prompt + max_new_tokens: warm up with the same length,
        # or the timed run would compile again.
        res["decode_tok_s_b1_static"] = run(1, plan.decode_new, cache_implementation="static")
    except Exception as e:  # noqa: BLE001 - compile may be unavailable (e.g. no C compiler)
        res["decode_tok_s_b1_static_error"] = f"{type(e).__name__}: {e}"
    res[f"decode_tok_s_b{plan.big_batch}"] = run(plan.big_batch, 4)
    del model
    return res


# -- report --------------------------------------------------------------------------------------
def table(plan: Plan, r: Results) -> str:
    f = r.figures
    kv1, hf1 = f.get("kvserve_throughput") or {}, f.get("hf_throughput") or {}
    kv2, hf2 = f.get("kvserve_7b") or {}, f.get("hf_7b") or {}
    bw = f.get("copy_bandwidth_Bps")

    def num(x: Any, fmt: str = "{:,.0f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    roof = kv2.get("roofline_tok_s")
    hf_static = hf2.get("decode_tok_s_b1_static")
    rows = [
        ("copy bandwidth (read + write)", num(bw and bw / 1e9, "{:,.0f} GB/s"), ""),
        (f"(1) {plan.small_size}, {plan.num_requests} req, output tok/s",
         num(kv1.get("output_tok_s")),
         f"{num(hf1.get('output_tok_s'))} (first {hf1.get('requests', '?')} req, "
         f"max_new {hf1.get('max_new_tokens', '?')})"),
        (f"(2) {plan.big_size}, batch 1 decode tok/s", num(kv2.get("decode_tok_s_b1"), "{:,.1f}"),
         f"{num(hf2.get('decode_tok_s_b1'), '{:,.1f}')} default, "
         f"{num(hf_static, '{:,.1f}')} static+compiled"),
        ("(2) batch 1 fraction of HBM roofline",
         num(kv2.get("roofline_fraction_b1"), "{:.0%}") + f" of {num(roof, '{:,.0f}')} tok/s",
         num(hf_static and roof and hf_static / roof, "{:.0%}") + " (static)"),
        (f"(2) batch {plan.big_batch} decode tok/s",
         num(kv2.get(f"decode_tok_s_b{plan.big_batch}")),
         num(hf2.get(f"decode_tok_s_b{plan.big_batch}"))),
    ]
    for n in plan.ttft_lens:
        rows.append((f"(3) TTFT {n} tokens, cold / prefix cached (ms)",
                     f"{num(kv2.get(f'ttft_{n}_cold_ms'), '{:,.1f}')} / "
                     f"{num(kv2.get(f'ttft_{n}_cached_ms'), '{:,.1f}')}", ""))
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows + [("", "kvserve", "")])
    lines = [f"{'figure':<{w0}} | {'kvserve':>{w1}} | transformers",
             f"{'-' * w0}-+-{'-' * w1}-+-{'-' * 12}"]
    lines += [f"{a:<{w0}} | {b:>{w1}} | {c}" for a, b, c in rows]
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
    parser.add_argument("--hf-requests", type=int, default=None)
    parser.add_argument("--hf-max-new", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"),
                        default="auto", help="with --smoke, triton runs Triton's interpreter "
                        "on the CPU (slower: about a minute)")
    args = parser.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan()
    if args.hf_requests is not None:
        plan.hf_requests = args.hf_requests
    if args.hf_max_new is not None:
        plan.hf_max_new = args.hf_max_new
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
    f["kvserve_7b"] = guarded(results, "kvserve_7b", lambda: kvserve_decode_and_ttft(
        plan, ckpt, f["copy_bandwidth_Bps"] or float("nan")))
    if not args.skip_transformers:
        f["hf_throughput"] = guarded(results, "hf_throughput", lambda: hf_throughput(plan, ckpt))
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
