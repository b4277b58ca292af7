#!/usr/bin/env python
"""Offline throughput: kvserve vs Hugging Face transformers `generate`, side by side, one run.

Workloads (greedy, every request generates the full length):
  main     64 prompts x 128 random tokens -> 128 new tokens each (transformers: one batch of 64)
  batch1   1 prompt x 128 -> 128
each in float32 and (unless --skip-bf16) bfloat16. Metric: output tokens / end-to-end generate
wall time (model load excluded; each worker does one tiny warm-up generate first).

Every measurement runs in its own subprocess (`--worker ...`, JSON on stdout) with
torch.set_num_threads(--threads), so neither engine's memory or thread state leaks into the
other's. Each measurement is repeated --repeats times, alternating the engines, and reported as
median [min-max], with the ratio of medians kvserve / transformers. The script also measures the
machine's fp32 (and bf16) matmul ceiling itself and reports the fraction of it that the main
workload reaches.

    .venv/bin/python benchmarks/bench_throughput.py                # full run (several minutes)
    .venv/bin/python benchmarks/bench_throughput.py --quick        # smoke test: 16x32->32, 1 repeat
    .venv/bin/python benchmarks/bench_throughput.py --json out.json --skip-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

# Interference (the CPU other processes took during a run) and wait_for_quiet: kvserve.bench.noise
from kvserve.bench.noise import Interference, wait_for_quiet  # noqa: F401  (bt.wait_for_quiet)
from kvserve.kv.prefix_index import common_prefix
from kvserve.kernels.cpu.cpu_features import (ISA_CAPS, ISA_ENV, LIBRARY_ISA_ENV, cpu_info,
                                              isa_cap_env, l3_cache_bytes)
from kvserve.paths import cache_dir

REPO = Path(__file__).resolve().parent.parent
# The script `run_worker` starts with `--worker`; a benchmark that reuses this runner for its own
# workers points it at itself.
WORKER_SCRIPT = os.path.abspath(__file__)
ENGINES = ("kvserve", "transformers")
ANCHOR_FP32_GFLOPS = 190.0  # /work/shared/ANCHORS.md: nominal fp32 matmul ceiling of the machine
ANCHOR_BF16_GFLOPS = 430.0


# ------------------------------------------------------------------------------------------
# checkpoint and FLOP accounting (main process: no torch import needed)
# ------------------------------------------------------------------------------------------
def checkpoint_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


_STAMP_FILE = ".bench-stamp.json"
_STAMP_CODE = """
import hashlib, inspect, json
from kvserve.model_loader import make_model as m
config = m.hf_config("qwen2", "small", "float32")
code = inspect.getsource(m.random_weights).encode()
print(json.dumps({"config": config, "random_weights": hashlib.sha256(code).hexdigest()},
                 sort_keys=True))
"""


def _make_model_stamp(timeout: float) -> str:
    """What make_model would write now (config + weight-generator code), to detect a stale
    cached checkpoint after make_model changes."""
    out = subprocess.run([sys.executable, "-c", _STAMP_CODE], check=True, cwd=REPO,
                         timeout=timeout, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def ensure_checkpoint(path: Path, timeout: float) -> Path:
    """Create the reference checkpoint once (in a subprocess) and re-use it while make_model's
    config and weight generator stay the same; rebuild it when they change."""
    stamp = _make_model_stamp(timeout)
    stamp_file = path / _STAMP_FILE
    if checkpoint_ready(path) and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    why = "stale (make_model changed)" if checkpoint_ready(path) else "missing"
    print(f"reference checkpoint {why}: creating it (qwen2, small, seed 0, float32) in {path}",
          file=sys.stderr)
    code = ("import sys; from kvserve.model_loader.make_model import make_model; "
            "make_model(sys.argv[1], arch='qwen2', size='small', seed=0, dtype='float32')")
    subprocess.run([sys.executable, "-c", code, str(tmp)], check=True, cwd=REPO, timeout=timeout)
    if not checkpoint_ready(tmp):
        raise RuntimeError(f"make_model wrote no checkpoint into {tmp}")
    (tmp / _STAMP_FILE).write_text(stamp)
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        path.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:  # another run created it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not checkpoint_ready(path):
            raise
    return path


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = meta["shape"]
    return shapes


def param_counts(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = safetensors_shapes(model_dir)
    numel = {k: _prod(v) for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}
    total = sum(numel.values())
    embed = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    head_stored = sum(v for k, v in numel.items() if k.endswith("lm_head.weight"))
    lm_head = cfg["vocab_size"] * cfg["hidden_size"]  # tied or not, the head does this work
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return {"total_stored": total, "embedding": embed,
            "non_embedding": total - embed - head_stored, "lm_head": lm_head,
            "tied": bool(cfg.get("tie_word_embeddings", False)),
            # fp32 K and V of one token over all layers: what each later decode step re-reads
            "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4}


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def workload_flops(params: dict[str, int], n_prompts: int, prompt_len: int, gen: int) -> float:
    """2 x non-embedding params per token (prompt + generated) + 2 x LM head per generated
    token (the last prompt position and each decode step are the only rows that need logits)."""
    return n_prompts * (2.0 * params["non_embedding"] * (prompt_len + gen)
                        + 2.0 * params["lm_head"] * gen)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # stay clear of the low ids where tokenizers keep their special tokens
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# ------------------------------------------------------------------------------------------
# workers (one subprocess per measurement)
# ------------------------------------------------------------------------------------------
def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def worker_ceiling(args: argparse.Namespace) -> dict:
    """fp32 and bf16 matmul GFLOP/s: 2048 x 2048 @ 2048 x 2048, median of --samples timings."""
    import torch

    _set_threads(args.threads)
    from kvserve.kernels.cpu.cpu_features import cpu_info

    n = 2048
    out: dict = {"threads": torch.get_num_threads()}
    noise = Interference().__enter__()
    # bf16 without bf16 instructions is emulated: a 2048^3 matmul does not finish in minutes
    dtypes = (("float32", torch.float32), ("bfloat16", torch.bfloat16)) if cpu_info().has_bf16 \
        else (("float32", torch.float32),)
    for name, dt in dtypes:
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        c = torch.empty(n, n, dtype=dt)
        for _ in range(3):
            torch.mm(a, b, out=c)
        times = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - t0)
        gflops = [2.0 * n ** 3 / t / 1e9 for t in times]
        out[name] = {"median_gflops": statistics.median(gflops), "min_gflops": min(gflops),
                     "max_gflops": max(gflops), "samples": len(gflops)}
    out["copy_gbps"] = copy_bandwidth(args.samples)
    params = param_counts(Path(args.model)) if args.model else None
    read_bytes = args.read_bytes or (weight_bytes(params) if params else 0)
    if read_bytes:
        out["read_gbps"] = read_bandwidth(args.samples, read_bytes)
    if params and args.max_tokens and read_bytes:
        mean_ctx = args.prompt_len + args.max_tokens // 2  # the decode steps' mean context
        kv_bytes = args.num_prompts * params["kv_bytes_per_token"] * mean_ctx
        out["kv_read_gbps"] = read_bandwidth(args.samples, kv_bytes, between=read_bytes)
    out["l3_bytes"] = l3_cache_bytes()
    if args.model:
        out["gemm"] = model_gemm_ceiling(args)
    noise.__exit__(None, None, None)
    out.update(noise.result)
    return out


def copy_bandwidth(samples: int, mib: int = 256) -> dict:
    """Memory copy bandwidth, GB/s counted as bytes read + bytes written, of a `mib` MiB
    buffer (far beyond the caches of a 2-core VM slice): median and max of `samples`."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(samples):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return {"median": statistics.median(rates), "max": max(rates), "samples": len(rates)}


def weight_bytes(params: dict[str, int]) -> int:
    """fp32 bytes a batch-1 decode step reads: every layer's weights and the LM head."""
    return 4 * (params["non_embedding"] + params["lm_head"])


def read_bandwidth(samples: int, nbytes: int, between: int = 0) -> dict:
    """Read-only bandwidth, GB/s, of a buffer of `nbytes`, each sample one pass over it after a
    warm pass. The model's weights: the batch-1 decode ceiling (where they fit in the L3
    cache they are read from there at each step, not from DRAM, so a DRAM copy bandwidth
    understates what is reachable). `between`: bytes of another buffer read before each
    timed pass, as a decode step reads all the weights between two reads of the K/V: the
    rate the K/V can be read at in an engine, which the L3 helps far less. The pass is
    kvserve's C++ read kernel (csrc/gemv.cpp) on torch's threads, or torch.sum without a
    compiler."""
    import torch

    from kvserve.kernels.cpu import gemv

    kernel = gemv.load()

    def reader(t: torch.Tensor):
        return (lambda: kernel.read_sum(t)) if kernel is not None else (lambda: float(t.sum()))

    buf = torch.ones(nbytes // 4)
    read = reader(buf)
    other = reader(torch.ones(between // 4)) if between else (lambda: None)
    read()
    read()
    rates = []
    for _ in range(samples):
        other()
        t0 = time.perf_counter()
        read()
        rates.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return {"median": statistics.median(rates), "max": max(rates), "samples": len(rates),
            "bytes": buf.numel() * 4, "kernel": "c++" if kernel is not None else "torch.sum"}


def model_gemm_ceiling(args: argparse.Namespace) -> dict:
    """The reference model's own projections (qkv, o, gate/up + SwiGLU, down; LM head) at the
    best kernel this CPU offers for each shape: min time of F.linear (MKL), oneDNN with
    packed weights and (up to 4 rows) kvserve's C++ GEMV, exact row counts, best of
    --samples. Rows: 1 and the main workload's
    decode batch, its prefill step and the prefill's sampled rows. Seconds per call."""
    import torch

    from kvserve.layers.gemm_select import time_once
    from kvserve.worker.model_build import load_model

    model, config = load_model(args.model, "float32", pack_weights=False)
    from kvserve.layers.selection import gemm_candidates

    cands = gemm_candidates(model.layers[0], model.head_weight(), layer_ops=False)
    prefill = min(args.num_prompts * args.prompt_len, args.max_batched_tokens)
    out: dict = {"layers": config.num_hidden_layers, "rows": {}}
    with torch.inference_mode():
        for rows in sorted({1, args.num_prompts, prefill}):
            per: dict = {}
            for proj, kernels in cands.items():
                per[proj] = {}
                for kernel, factory in kernels.items():
                    run = factory(rows)
                    if run is None:  # a kernel not offered for this many rows (gemv)
                        continue
                    run()
                    calls = max(1, min(20, int(2e-3 / max(time_once(run, 1), 1e-7))))
                    per[proj][kernel] = min(time_once(run, calls) for _ in range(args.samples))
            out["rows"][str(rows)] = per
    return out


def gemm_ceiling_seconds(gemm: dict, n: int, plen: int, gen: int, max_batched: int) -> float:
    """Seconds the workload's projections alone take at the best kernel per shape: the prefill
    in steps of max_batched rows (LM head on the n sampled rows), then gen - 1 decode steps
    of n rows (all layers + LM head)."""
    def best(rows: int, proj: str) -> float:
        return min(gemm["rows"][str(rows)][proj].values())

    layers = gemm["layers"]

    def step(rows: int) -> float:
        return layers * sum(best(rows, p) for p in ("qkv", "o", "mlp", "down"))

    total, left = 0.0, n * plen
    while left > 0:
        rows = min(left, max_batched)
        total += step(rows) * (rows / min(n * plen, max_batched))  # last chunk: pro rata
        left -= rows
    total += best(n, "head") + (gen - 1) * (step(n) + best(n, "head"))
    return total


def _result(args, wall: float, outputs: list[list[int]], load_s: float, **extra) -> dict:
    out_tokens = sum(len(o) for o in outputs)
    expected = args.num_prompts * args.max_tokens
    res = {"engine": args.engine, "dtype": args.dtype, "num_prompts": args.num_prompts,
           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "wall_s": wall,
           "out_tokens": out_tokens, "tok_s": out_tokens / wall, "load_s": load_s,
           "full_length": out_tokens == expected,
           "first_outputs": [list(map(int, o)) for o in outputs[:4]]}
    res.update(extra)
    return res


def worker_kvserve(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import torch

    _set_threads(args.threads)
    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    control = {"kv_tenant_quota": 0.5} if args.kv_control else {}
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
              max_num_seqs=max(args.num_prompts, 2),
              max_model_len=args.prompt_len + args.max_tokens, block_size=16, **control)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:2]], warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            kv_cache_report=args.kv_cache_report,
                            kv_retention={"priority": 60, "ttl": "10m"} if args.kv_control
                            else None)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    prof = _maybe_profiler(args)
    start_wall = time.time()
    t0 = time.perf_counter()
    with Interference() as noise, prof:
        outs = llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    _dump_profile(prof, args)
    tokens = [o.outputs[0].token_ids for o in outs]
    firsts = [o.metrics.first_token_time for o in outs]
    lasts = [o.metrics.last_token_time for o in outs]
    extra: dict = {"threads": torch.get_num_threads(), **noise.result}
    if all(t is not None for t in firsts + lasts):
        prefill_s = max(firsts) - start_wall  # all prompts have their first token
        decode_s = max(lasts) - max(firsts)
        extra["prefill_s"] = prefill_s
        extra["ttft_s"] = statistics.median(f - start_wall for f in firsts)
        if decode_s > 0:
            extra["decode_tok_s"] = sum(len(t) - 1 for t in tokens) / decode_s
        if len(outs) == 1 and lasts[0] > firsts[0]:
            # per-request decode rate, TTFT excluded: (n - 1) / (last - first token time)
            extra["decode_tok_s"] = (len(tokens[0]) - 1) / (lasts[0] - firsts[0])
    return _result(args, wall, tokens, load_s, **extra)


def worker_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import torch
    import transformers

    _set_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else model.config.pad_token_id
    gc.pad_token_id = 0 if pad is None else (pad[0] if isinstance(pad, list) else pad)
    gc.eos_token_id = None  # never stop early: every row generates max_new_tokens
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None

    def run(batch: list[list[int]], new: int) -> tuple[float, torch.Tensor]:
        ids = torch.tensor(batch, dtype=torch.long)
        mask = torch.ones_like(ids)  # all prompts have the same length: no padding
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, generation_config=gc)
        return time.perf_counter() - t, out[:, ids.shape[1]:]

    run([p[:8] for p in prompts[:2]], 4)  # warm-up
    prof = _maybe_profiler(args)
    with Interference() as noise, prof:
        wall, new_tokens = run(prompts, args.max_tokens)
    _dump_profile(prof, args)
    tokens = new_tokens.tolist()
    extra: dict = {"threads": torch.get_num_threads(), **noise.result,
                   "transformers": transformers.__version__,
                   "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    if not args.no_split:
        # prefill estimate: the same generate with one new token; decode = the rest of the time
        with Interference() as split_noise:
            prefill_s, _ = run(prompts, 1)
        extra["split_foreign_cores"] = split_noise.result.get("foreign_cores")
        extra["prefill_s"] = extra["ttft_s"] = prefill_s
        if wall > prefill_s:
            extra["decode_tok_s"] = sum(len(t) - 1 for t in tokens) / (wall - prefill_s)
            extra["decode_is_estimate"] = True
    return _result(args, wall, tokens, load_s, **extra)


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _maybe_profiler(args):
    if not args.profile:
        return _NullCtx()
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=False, with_stack=False)


def _dump_profile(prof, args) -> None:
    if not args.profile:
        return
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    Path(args.profile).write_text(table)
    print(table, file=sys.stderr)


def worker_main(args: argparse.Namespace) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # libraries may print; stdout carries only the JSON result
    try:
        if args.worker == "ceiling":
            result = worker_ceiling(args)
        else:
            from kvserve.model_loader.gguf_checkpoint import is_gguf, open_gguf

            # a GGUF file's metadata as a config.json (in the directory open_gguf writes)
            config_dir = open_gguf(args.model).dir if is_gguf(args.model) else Path(args.model)
            cfg = json.loads((Path(config_dir) / "config.json").read_text())
            prompts = make_prompts(args.num_prompts, args.prompt_len, cfg["vocab_size"],
                                   args.seed)
            fn = worker_kvserve if args.engine == "kvserve" else worker_transformers
            result = fn(args, prompts)
    finally:
        sys.stdout = real_stdout
    print(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def run_worker(argv: list[str], threads: int, timeout: float, script: str | None = None,
               tree: Path | None = None) -> dict:
    """One worker subprocess (`script --worker ...`, this file's own by default); with `tree`,
    run from that checkout and import its kvserve (bench_vs_commit.py)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, script or WORKER_SCRIPT, "--worker", *argv,
           "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=tree or REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": cmd}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"error": f"exit code {proc.returncode}: {tail}", "cmd": cmd}
    return json.loads(lines[-1])


def measure(argv: list[str], args: argparse.Namespace, label: str, write) -> dict:
    """Run one worker; if other processes took more than --noise-threshold cores during its
    timed section, wait for a quiet moment and run it again (at most --max-retries times).
    Keeps the least disturbed successful attempt."""
    attempts: list[dict] = []
    for attempt in range(args.max_retries + 1):
        before = wait_for_quiet(args.noise_threshold, args.quiet_wait) \
            if args.quiet_wait > 0 else None
        res = run_worker(argv, args.threads, args.timeout)
        res["attempt"] = attempt
        res["foreign_cores_before"] = before
        attempts.append(res)
        if "error" in res or res.get("foreign_cores", 0.0) < args.noise_threshold:
            break
        if attempt < args.max_retries:
            write(f"{label}: disturbed (other processes used {res['foreign_cores']:.2f} "
                  f"cores during the timed run), re-running")
    good = [a for a in attempts if "error" not in a]
    kept = min(good, key=lambda a: a.get("foreign_cores", 0.0)) if good else attempts[-1]
    kept["retries"] = len(attempts) - 1
    kept["discarded"] = [{k: a.get(k) for k in ("tok_s", "wall_s", "foreign_cores", "error",
                                                  "median_gflops") if k in a}
                         for a in attempts if a is not kept]
    return kept


def machine_ceilings(ceilings: list[dict], params: dict[str, int], n: int, plen: int,
                     gen: int) -> dict:
    """In-run ceilings, the best over the ceiling runs (one at the start, one at the end; a run
    that a neighbour disturbed understates the machine, and the best is the stricter
    yardstick): the main workload's projections at the best GEMM per shape (seconds), each
    GEMM's time per row count, the copy and read bandwidths and the batch-1 decode limit they
    imply (fp32 weights read once per token)."""
    out: dict = {}
    gemms = [c["gemm"] for c in ceilings if "gemm" in c]
    if gemms:
        out["gemm_ceiling_s"] = min(gemm_ceiling_seconds(g, n, plen, gen, 8192) for g in gemms)
        per_rows = {}
        for rows in gemms[0]["rows"]:
            choices = {}
            for proj, kernels in gemms[0]["rows"][rows].items():
                best = {k: min(g["rows"][rows][proj][k] for g in gemms) for k in kernels}
                choices[proj] = {k: round(v * 1e6, 1) for k, v in best.items()}
            per_rows[rows] = choices
        out["gemm_us"] = per_rows
    copies = [c["copy_gbps"]["median"] for c in ceilings if "copy_gbps" in c]
    out["bytes_per_token"] = weight_bytes(params)
    if copies:
        out["copy_gbps"] = max(copies)
        out["dram_limit_tok_s"] = out["copy_gbps"] * 1e9 / out["bytes_per_token"]
        out["batch1_limit_tok_s"] = out["dram_limit_tok_s"]
    reads = [c["read_gbps"]["median"] for c in ceilings if "read_gbps" in c]
    if reads:  # the corrected limit: read bandwidth of a weight-sized (maybe L3-resident) buffer
        out["read_gbps"] = max(reads)
        out["batch1_limit_tok_s"] = out["read_gbps"] * 1e9 / out["bytes_per_token"]
    l3 = [c["l3_bytes"] for c in ceilings if c.get("l3_bytes")]
    if l3:
        out["l3_bytes"] = l3[0]
    if "gemm_ceiling_s" in out and "read_gbps" in out and "kv_bytes_per_token" in params:
        # Decode step t (1 .. gen - 1) attends to plen + t tokens of each of the n sequences.
        kv = n * params["kv_bytes_per_token"] * sum(plen + t for t in range(1, gen))
        out["kv_read_bytes"] = kv
        out["kv_read_s"] = kv / (out["read_gbps"] * 1e9)
        out["gemm_kv_floor_s"] = out["gemm_ceiling_s"] + out["kv_read_s"]
        kv_rates = [c["kv_read_gbps"]["median"] for c in ceilings if "kv_read_gbps" in c]
        if kv_rates:  # the same bytes at the rate they come at with the weights read between
            out["kv_engine_gbps"] = max(kv_rates)
            out["kv_engine_read_s"] = kv / (out["kv_engine_gbps"] * 1e9)
            out["gemm_kv_engine_floor_s"] = out["gemm_ceiling_s"] + out["kv_engine_read_s"]
    return out


def describe_bandwidth_limit(machine: dict) -> str:
    """e.g. '156 MB of fp32 weights per token / 34.1 GB/s read (L3 260 MiB) = 219 tok/s;
    DRAM copy 23.6 GB/s = 152 tok/s'."""
    mb = machine["bytes_per_token"] / 1e6
    l3 = machine.get("l3_bytes")
    l3_s = f"L3 {l3 / 2**20:.0f} MiB" if l3 else "L3 size unknown"
    parts = []
    if "read_gbps" in machine:
        parts.append(f"{mb:.0f} MB of fp32 weights per token / {machine['read_gbps']:.1f} GB/s "
                     f"read of a weight-sized buffer ({l3_s}) = "
                     f"{machine['batch1_limit_tok_s']:.0f} tok/s")
    if "copy_gbps" in machine:
        parts.append(f"DRAM copy {machine['copy_gbps']:.1f} GB/s = "
                     f"{machine['dram_limit_tok_s']:.0f} tok/s")
    return "; ".join(parts)


def print_machine_ceilings(machine: dict, table: list[dict], engines: list[str],
                           params: dict[str, int]) -> None:
    if "gemm_us" in machine:
        print("best GEMM per shape (us per call, min over samples; dense = F.linear/MKL, "
              "onednn = packed, gemv / panel = kvserve's C++ kernels):")
        for rows, per in machine["gemm_us"].items():
            cells = ", ".join(f"{p} " + "/".join(f"{k} {v:.0f}" for k, v in ks.items())
                              for p, ks in per.items())
            print(f"  {rows:>5} rows: {cells}")
    if "gemm_kv_floor_s" in machine:
        print(f"  the decode steps re-read {machine['kv_read_bytes'] / 1e9:.1f} GB of fp32 K/V: "
              f"{machine['kv_read_s']:.2f} s at the in-run read bandwidth "
              f"({machine['read_gbps']:.1f} GB/s); with the projections at the GEMM ceiling a "
              f"run takes at least {machine['gemm_kv_floor_s']:.2f} s, so at most "
              f"{100 * machine['gemm_ceiling_s'] / machine['gemm_kv_floor_s']:.1f}% of the GEMM "
              f"ceiling is reachable (before norms, RoPE, sampling, scheduling)")
    if "gemm_kv_engine_floor_s" in machine:
        print(f"  read as a decode step reads it, after the weights (a K/V-sized buffer read "
              f"right after a weight-sized one: {machine['kv_engine_gbps']:.1f} GB/s), the K/V "
              f"takes {machine['kv_engine_read_s']:.2f} s: at most "
              f"{100 * machine['gemm_ceiling_s'] / machine['gemm_kv_engine_floor_s']:.1f}% of "
              f"the GEMM ceiling is reachable ({machine['gemm_kv_engine_floor_s']:.2f} s)")
    for row in table:
        if row["dtype"] != "float32":
            continue
        for eng in engines:
            wall = row[eng]["wall_s"]
            if row["workload"] == "main" and wall and "gemm_ceiling_s" in machine:
                frac = machine["gemm_ceiling_s"] / wall["median"]
                row[eng]["frac_gemm_ceiling"] = frac
                print(f"  {eng:<13} main float32: {100 * frac:.1f}% of the in-run GEMM ceiling "
                      f"(the model's projections alone at the best kernel per shape: "
                      f"{machine['gemm_ceiling_s']:.2f} s; the run took {wall['median']:.2f} s)")
                if "gemm_kv_floor_s" in machine:
                    floor = machine["gemm_kv_floor_s"] / wall["median"]
                    row[eng]["frac_gemm_kv_floor"] = floor
                    print(f"  {eng:<13} main float32: {100 * floor:.1f}% of the projections at "
                          f"the ceiling plus the decode's K/V read at the read bandwidth "
                          f"({machine['gemm_kv_floor_s']:.2f} s)")
            dec = row[eng]["decode_tok_s"]
            if row["workload"] == "batch1" and dec and "batch1_limit_tok_s" in machine:
                frac = dec["median"] / machine["batch1_limit_tok_s"]
                row[eng]["frac_bandwidth_limit"] = frac
                print(f"  {eng:<13} batch-1 float32 decode: {dec['median']:.1f} tok/s = "
                      f"{100 * frac:.1f}% of the in-run memory-bandwidth limit "
                      f"({describe_bandwidth_limit(machine)})")


def summarize(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt_stat(s: dict | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke test: 16x32->32, 1 repeat")
    p.add_argument("--skip-bf16", action="store_true", help="float32 only")
    p.add_argument("--json", metavar="OUT", help="also write all results to this JSON file")
    p.add_argument("--model", help="checkpoint directory (default: the cached reference model, "
                   "created once with make_model(arch='qwen2', size='small', seed=0))")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of kvserve,transformers")
    p.add_argument("--num-prompts", type=int, default=None, help="main workload (default 64)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128")
    p.add_argument("--output-len", type=int, default=None, help="default 128")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    p.add_argument("--no-split", action="store_true",
                   help="skip transformers' extra max_new_tokens=1 run (prefill estimate)")
    p.add_argument("--noise-threshold", type=float, default=0.3,
                   help="a run during which other processes (or steal) used more CPU cores than "
                   "this counts as disturbed and is re-run (default 0.3)")
    p.add_argument("--max-retries", type=int, default=2,
                   help="re-runs of a disturbed measurement; the least disturbed attempt is "
                   "kept (default 2; 0 disables)")
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each run wait up to this many seconds for other processes to "
                   "go quiet (default 20; 0 disables)")
    p.add_argument("--verbose", action="store_true", help="print each worker command")
    p.add_argument("--cpu-isa", choices=["native", *ISA_CAPS],
                   help="run every worker (kvserve's, the peers', the ceilings) capped to this "
                   "instruction set: kvserve's kernels built for it, ATen, MKL and oneDNN "
                   "limited to it (an AVX2-only CPU emulated on a newer one); native: no cap, "
                   "whatever the environment says (default: as the environment says)")
    # worker-only flags
    p.add_argument("--worker", choices=["bench", "ceiling"], help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=9, help=argparse.SUPPRESS)
    p.add_argument("--read-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-batched-tokens", type=int, default=8192, help=argparse.SUPPRESS)
    # bench_cache_control.py: every request with a cache report / a retention under quotas
    p.add_argument("--kv-cache-report", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kv-control", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", metavar="FILE",
                   help="worker only: torch-profile the timed generate, write the top ops here")
    p.add_argument("--profile-rows", type=int, default=30, help=argparse.SUPPRESS)
    add_record_arg(p, "offline-throughput")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)

    from tqdm import tqdm

    if args.cpu_isa:  # the workers inherit it; this process's own CPU line too
        for var in (ISA_ENV, *LIBRARY_ISA_ENV):
            os.environ.pop(var, None)
        if args.cpu_isa != "native":
            os.environ.update(isa_cap_env(args.cpu_isa))
        cpu_info.cache_clear()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines must be a subset of {','.join(ENGINES)}")
    repeats = args.repeats or (1 if args.quick else 3)
    n_main = args.num_prompts or (16 if args.quick else 64)
    plen = args.prompt_len or (32 if args.quick else 128)
    gen = args.output_len or (32 if args.quick else 128)
    dtypes = ["float32"] if args.skip_bf16 else ["float32", "bfloat16"]
    workloads = {"main": n_main, "batch1": 1}
    wl_name = {"main": f"{n_main} x {plen} -> {gen}", "batch1": f"1 x {plen} -> {gen}"}

    model_dir = Path(args.model) if args.model else cache_dir() / "bench-qwen2-small"
    if not args.model:
        ensure_checkpoint(model_dir, args.timeout)
    elif not checkpoint_ready(model_dir):
        p.error(f"{model_dir} holds no config.json + *.safetensors checkpoint")
    params = param_counts(model_dir)

    # the job list: ceilings first and last (the machine is noisy), engines alternating
    jobs: list[tuple[str, dict]] = [("ceiling", {})]
    for r in range(repeats):
        order = engines if r % 2 == 0 else engines[::-1]
        for dt in dtypes:
            for wl in workloads:
                for eng in order:
                    jobs.append(("bench", {"engine": eng, "dtype": dt, "workload": wl,
                                           "repeat": r}))
    jobs.append(("ceiling", {}))

    results: list[dict] = []
    ceilings: list[dict] = []
    t_start = time.time()
    bar = tqdm(jobs, desc="benchmark", unit="run", dynamic_ncols=True, file=sys.stderr)

    def write(msg: str) -> None:
        tqdm.write(msg, file=sys.stderr)

    for kind, job in bar:
        if kind == "ceiling":
            bar.set_postfix_str("matmul ceiling")
            res = measure(["ceiling", "--model", str(model_dir), "--num-prompts", str(n_main),
                           "--prompt-len", str(plen), "--max-tokens", str(gen)], args,
                          "matmul ceiling", write)
            ceilings.append(res)
            if "error" in res:
                tqdm.write(f"ceiling run failed: {res['error']}", file=sys.stderr)
            continue
        bar.set_postfix_str(f"{job['engine']} {job['dtype']} {job['workload']} "
                            f"#{job['repeat'] + 1}")
        wargv = ["bench", "--engine", job["engine"], "--dtype", job["dtype"],
                 "--model", str(model_dir), "--num-prompts", str(workloads[job["workload"]]),
                 "--prompt-len", str(plen), "--max-tokens", str(gen), "--seed", str(args.seed)]
        if args.no_split:
            wargv.append("--no-split")
        if args.verbose:
            tqdm.write(" ".join([sys.executable, __file__, "--worker", *wargv]), file=sys.stderr)
        res = measure(wargv, args, f"{job['engine']} {job['dtype']} {job['workload']} "
                      f"#{job['repeat'] + 1}", write)
        res.update(job)
        if (res.get("split_foreign_cores") or 0.0) >= args.noise_threshold:
            # transformers' prefill estimate was disturbed: drop it and the decode derived from it
            for key in ("prefill_s", "ttft_s", "decode_tok_s"):
                res.pop(key, None)
            res["split_disturbed"] = True
        results.append(res)
        if "error" in res:
            tqdm.write(f"{job['engine']} {job['dtype']} {job['workload']} failed: "
                       f"{res['error']}", file=sys.stderr)
        elif not res["full_length"]:
            tqdm.write(f"warning: {job['engine']} {job['dtype']} {job['workload']} generated "
                       f"{res['out_tokens']} tokens, expected "
                       f"{workloads[job['workload']] * gen}", file=sys.stderr)
    bar.close()
    elapsed = time.time() - t_start

    # ---- aggregate ----
    def ok(eng, dt, wl):
        return [r for r in results if r["engine"] == eng and r["dtype"] == dt
                and r["workload"] == wl and "error" not in r]

    def stat(eng, dt, wl, key):
        return summarize([r[key] for r in ok(eng, dt, wl) if r.get(key) is not None])

    ceil_ok = [c for c in ceilings if "error" not in c]
    ceiling = {dt: summarize([c[dt]["median_gflops"] for c in ceil_ok]) for dt in dtypes}
    flops_main = workload_flops(params, n_main, plen, gen)

    table = []
    for dt in dtypes:
        for wl in workloads:
            row = {"workload": wl, "shape": wl_name[wl], "dtype": dt}
            for eng in engines:
                row[eng] = {k: stat(eng, dt, wl, k)
                            for k in ("tok_s", "wall_s", "decode_tok_s", "prefill_s", "ttft_s")}
                fc = [r.get("foreign_cores") for r in ok(eng, dt, wl)]
                row[eng]["foreign_cores_max"] = max((f for f in fc if f is not None),
                                                    default=None)
                row[eng]["errors"] = [r["error"] for r in results if r["engine"] == eng
                                      and r["dtype"] == dt and r["workload"] == wl
                                      and "error" in r]
            if all(row[e]["tok_s"] for e in ENGINES if e in engines) and len(engines) == 2:
                row["ratio"] = row["kvserve"]["tok_s"]["median"] / \
                    row["transformers"]["tok_s"]["median"]
                kd, hd = row["kvserve"]["decode_tok_s"], row["transformers"]["decode_tok_s"]
                if kd and hd:
                    row["decode_ratio"] = kd["median"] / hd["median"]
            # greedy agreement of the two engines on the first repeat (sanity check)
            if len(engines) == 2:
                a, b = ok("kvserve", dt, wl), ok("transformers", dt, wl)
                if a and b:
                    pairs = list(zip(a[0]["first_outputs"], b[0]["first_outputs"]))
                    if pairs:
                        row["greedy_common_prefix"] = [common_prefix(x, y) for x, y in pairs]
            for eng in engines:
                s = row[eng]["tok_s"]
                if wl == "main" and s:
                    wall = statistics.median([r["wall_s"] for r in ok(eng, dt, wl)])
                    achieved = flops_main / wall / 1e9
                    row[eng]["gflops"] = achieved
                    if ceiling.get(dt):
                        row[eng]["frac_measured_ceiling"] = achieved / ceiling[dt]["median"]
                    row[eng]["frac_anchor_ceiling"] = achieved / (
                        ANCHOR_FP32_GFLOPS if dt == "float32" else ANCHOR_BF16_GFLOPS)
            table.append(row)

    # ---- print ----
    print()
    print(f"kvserve vs transformers, offline throughput ({elapsed / 60:.1f} min, "
          f"{args.threads} threads, {repeats} repeat(s), median [min-max])")
    print(f"model: {model_dir}  ({params['total_stored'] / 1e6:.1f} M stored params, "
          f"{params['non_embedding'] / 1e6:.2f} M non-embedding, LM head "
          f"{params['lm_head'] / 1e6:.2f} M{', tied' if params['tied'] else ''})")
    print(f"host: {platform.node()}, python {platform.python_version()}, cpus {os.cpu_count()}")
    print(f"cpu: {cpu_info().summary()}")
    hdr = (f"{'workload':<18} {'dtype':<9} {'engine':<13} {'tok/s':>24} {'decode tok/s':>24} "
           f"{'prefill/TTFT s':>15} {'others':>6} {'kv/hf':>6}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for row in table:
        for i, eng in enumerate(engines):
            e = row[eng]
            dec = fmt_stat(e["decode_tok_s"])
            if eng == "transformers" and e["decode_tok_s"]:
                dec += "*"
            pre = e["prefill_s"]
            pre_s = f"{pre['median']:.3f}" if pre else "-"
            ratio = ""
            if i == len(engines) - 1 and "ratio" in row:
                ratio = f"{row['ratio']:.2f}x"
            tok = fmt_stat(e["tok_s"]) if e["tok_s"] else f"FAILED ({len(e['errors'])})"
            fcm = e["foreign_cores_max"]
            others = f"{fcm:.2f}" if fcm is not None else "-"
            print(f"{row['shape'] if i == 0 else '':<18} {row['dtype'] if i == 0 else '':<9} "
                  f"{eng:<13} {tok:>24} {dec:>24} {pre_s:>15} {others:>6} {ratio:>6}")
        if "decode_ratio" in row:
            print(f"{'':<18} {'':<9} {'':<13} {'':>24} "
                  f"{'decode kv/hf ' + format(row['decode_ratio'], '.2f') + 'x':>24}")
        if "greedy_common_prefix" in row:
            print(f"{'':<18} {'':<9} greedy agreement (common prefix of the first "
                  f"{len(row['greedy_common_prefix'])} outputs, of {gen}): "
                  f"{row['greedy_common_prefix']}")
    print("* transformers decode tok/s is an estimate: (tokens - rows) / (wall - wall of the "
          "same generate with max_new_tokens=1)")
    print("  kvserve decode tok/s: batch-1 (n-1)/(last - first token time); main workload: "
          "all decode tokens / (last token - last first token)")
    print("  prefill/TTFT s: kvserve, until every prompt has its first token; transformers, "
          "the same generate with max_new_tokens=1")
    retried = sum(r.get("retries", 0) for r in results + ceilings)
    disturbed = [r for r in results if r.get("foreign_cores", 0.0) >= args.noise_threshold]
    print(f"  others: most CPU cores used by other processes (+ steal) during a kept timed run; "
          f"{retried} disturbed run(s) re-run, {len(disturbed)} kept run(s) still above "
          f"{args.noise_threshold} cores")

    print()
    print("compute ceiling (2048x2048 matmul, median of runs at start and end of the benchmark):")
    for dt in dtypes:
        c = ceiling.get(dt)
        nominal = ANCHOR_FP32_GFLOPS if dt == "float32" else ANCHOR_BF16_GFLOPS
        print(f"  {dt:<9} measured {fmt_stat(c)} GFLOP/s   (ANCHORS nominal {nominal:.0f})")
    print(f"main workload {wl_name['main']}: {flops_main / 1e12:.3f} TFLOP "
          f"(2 x {params['non_embedding'] / 1e6:.2f} M x {plen + gen} tokens x {n_main} + "
          f"2 x {params['lm_head'] / 1e6:.2f} M x {gen} x {n_main})")
    for row in table:
        if row["workload"] != "main":
            continue
        for eng in engines:
            e = row[eng]
            if "gflops" not in e:
                continue
            meas = e.get("frac_measured_ceiling")
            meas_s = f"{100 * meas:.1f}%" if meas is not None else "-"
            print(f"  {eng:<13} {row['dtype']:<9} {e['gflops']:7.1f} GFLOP/s = {meas_s} of the "
                  f"measured {row['dtype']} ceiling, {100 * e['frac_anchor_ceiling']:.1f}% of "
                  f"the nominal {ANCHOR_FP32_GFLOPS if row['dtype'] == 'float32' else ANCHOR_BF16_GFLOPS:.0f}")
    machine = machine_ceilings(ceil_ok, params, n_main, plen, gen)
    print_machine_ceilings(machine, table, engines, params)
    errors = [r for r in results if "error" in r]
    if errors:
        print(f"\n{len(errors)} run(s) failed; first error:\n{errors[0]['error']}")

    if args.json:
        out = {"config": {"threads": args.threads, "repeats": repeats, "quick": args.quick,
                          "num_prompts": n_main, "prompt_len": plen, "output_len": gen,
                          "dtypes": dtypes, "engines": engines, "model": str(model_dir),
                          "seed": args.seed, "argv": sys.argv},
               "params": params, "flops_main": flops_main, "ceilings": ceilings,
               "ceiling": ceiling, "machine": machine, "table": table, "runs": results,
               "elapsed_s": elapsed}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    if args.record and "kvserve" in engines:
        record(args, table, engines)
    return 1 if errors and not any("error" not in r for r in results) else 0


def record(args: argparse.Namespace, table: list[dict], engines: list[str]) -> None:
    """The figures page's record: kvserve over transformers per workload and dtype (issue
    18's >= 1.3x on the main float32 workload), the main workload's share of the in-run GEMM
    ceiling (>= 90%) and batch-1 decode's share of the read limit (>= 70%)."""
    from kvserve.bench.record import Row, write_record

    rows = []
    for row in table:
        k, main32 = row["kvserve"], row["workload"] == "main" and row["dtype"] == "float32"
        hf = row.get("transformers", {}).get("tok_s") if "transformers" in engines else None
        if k["tok_s"]:
            r = row.get("ratio")
            rows.append(Row(f"{row['shape']}, {row['dtype']}", "tok/s",
                            round(k["tok_s"]["median"], 1),
                            round(hf["median"], 1) if hf else None,
                            None if r is None else round(r, 2), ">= 1.3x" if main32 else None,
                            r >= 1.3 if main32 and r is not None else None))
        if k.get("frac_gemm_ceiling") is not None:
            f = 100 * k["frac_gemm_ceiling"]
            rows.append(Row(f"{row['shape']}: share of the in-run GEMM ceiling", "%",
                            round(f, 1), None, None, ">= 90%", f >= 90))
        if k.get("frac_bandwidth_limit") is not None:
            f = 100 * k["frac_bandwidth_limit"]
            rows.append(Row(f"{row['shape']} decode: share of the in-run read limit", "%",
                            round(f, 1), None, None, ">= 70%", f >= 70))
    if rows:
        write_record(args.record, rows=rows,
                     title="Offline throughput against transformers, the reference model",
                     peer="transformers generate, in the same run" if "transformers" in engines
                     else "none: kvserve alone", notes=f"Medians, {args.threads} threads; "
                     "ratios of medians kvserve / transformers.")


if __name__ == "__main__":
    sys.exit(main())
