#!/usr/bin/env python
"""kvserve against llama.cpp on the GGUF files CPU users run (1B-8B, K-quants): batch-1 decode
after a 128-token prompt, prefill of 512 tokens, decode at --depth tokens of context, peak RSS
and load time, each file as a fraction of the machine's read bandwidth (issue 48).

The files come from make_gguf_models.py (random weights in the real models' shapes, converted
and quantized by llama.cpp's own tools). For each file and repeat, engines alternating:
- the read bandwidth of this machine at that moment: a weight-sized float32 buffer summed with
  --threads threads (torch), median of 5; a batch-1 decode reads every weight once a token, so
  weight bytes x tok/s / bandwidth is the fraction of the ceiling a decode reaches;
- kvserve in a fresh process: `LLM` on the file (its default: the file's blocks kept), one
  prompt of --prompt-len random ids -> --output-len greedy tokens (decode tok/s = (n - 1) /
  (last - first token time)), then a --prefill-len prompt for one token (prefill tok/s =
  tokens / TTFT), then with --depth a prompt of that length and 32 decoded tokens;
- llama.cpp's `llama-bench` on the same file and threads: `-p 0 -n OUT -d PROMPT` (decode after
  the same context), `-p PREFILL -n 0`, with --depth `-p 0 -n 32 -d DEPTH`, with --batch N
  `llama-batched-bench -npp PROMPT -ntg OUT -npl N` against kvserve's N prompts in one
  `generate` (output tokens / wall time, prefill included); its default f16
  KV cache against kvserve's float32 one (`--kv-cache-dtype int8` against `-ctk q8_0 -ctv
  q8_0`: --kv8).
Medians of the repeats and their ratios are printed, with the CPU's flags, and written as JSON.
`--isa avx2` runs kvserve with KVSERVE_CPU_ISA=avx2 and llama.cpp from --llama-bin-avx2 (a
build with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_gguf_scale.py \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36 --types Q4_K_M,Q8_0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import make_gguf_models  # noqa: E402


def read_bandwidth(nbytes: int, threads: int) -> float:
    """GB/s of summing a float32 buffer of nbytes (first touched, so resident) with `threads`
    threads: the bandwidth a decode's weight reads can reach here, now."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(max(nbytes // 4, 1 << 20), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def worker(args: argparse.Namespace) -> dict:
    """One kvserve measurement in this fresh process (printed as one JSON line)."""
    import torch

    torch.set_num_threads(args.threads)
    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    kv = {"kv_cache_dtype": "int8"} if args.kv8 else {}
    llm = LLM(args.gguf, max_model_len=max(args.depth, args.prefill_len,
                                           args.prompt_len + args.output_len) + 64,
              max_num_seqs=max(args.batch, 16), **kv)
    out = {"load_s": time.perf_counter() - t0,
           "load_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rng = random.Random(0)

    def run(n_prompt: int, n_out: int) -> tuple[float, float]:
        ids = [rng.randrange(100, 40000) for _ in range(n_prompt)]
        sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        start = time.time()
        m = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].metrics
        decode = (n_out - 1) / (m.last_token_time - m.first_token_time) if n_out > 1 else 0.0
        return m.first_token_time - start, decode

    run(16, 4)  # warm-up
    _, out["decode_tok_s"] = run(args.prompt_len, args.output_len)
    ttft, _ = run(args.prefill_len, 1)
    out["prefill_tok_s"] = args.prefill_len / ttft
    if args.depth:
        _, out["depth_decode_tok_s"] = run(args.depth, 32)
    if args.batch:  # N prompts at once: output tokens / wall time, prefill included
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000)
                                         for _ in range(args.prompt_len)]}
                   for _ in range(args.batch)]
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        out["batch_tok_s"] = args.batch * args.output_len / (time.perf_counter() - t0)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_kvserve(args: argparse.Namespace, gguf: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.isa == "avx2":
        env["KVSERVE_CPU_ISA"] = "avx2"
    cmd = [sys.executable, __file__, "--worker", "--gguf", str(gguf), "--threads",
           str(args.threads), "--prompt-len", str(args.prompt_len), "--output-len",
           str(args.output_len), "--prefill-len", str(args.prefill_len), "--depth",
           str(args.depth), "--batch", str(args.batch)] + (["--kv8"] if args.kv8 else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip()[-2000:]}
    return json.loads(lines[-1])


# runs argv[1:] and prints the peak RSS of that child alone (its own RUSAGE_CHILDREN)
_RSS_WRAPPER = ("import resource, subprocess, sys\n"
                "rc = subprocess.run(sys.argv[1:]).returncode\n"
                "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
                " file=sys.stderr)\n"
                "sys.exit(rc)\n")


def llama_bench(args: argparse.Namespace, bin_dir: Path, gguf: Path, extra: list[str],
                rss: list[float] | None = None) -> float:
    """tokens/s of one llama-bench test (its own average over -r 1); its peak RSS (MB)
    appended to `rss`."""
    kv = ["-ctk", "q8_0", "-ctv", "q8_0"] if args.kv8 else []
    cmd = [sys.executable, "-c", _RSS_WRAPPER, str(bin_dir / "llama-bench"), "-m", str(gguf),
           "-t", str(args.threads), "-r", "1", "-o", "jsonl", "-fa", args.llama_fa, *kv,
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(proc.stderr.strip()[-2000:])
    if rss is not None:
        rss += [int(ln.split()[1]) / 1024 for ln in proc.stderr.splitlines()
                if ln.startswith("MAXRSS ")]
    return float(rows[-1]["avg_ts"])


def run_llamacpp(args: argparse.Namespace, bin_dir: Path, gguf: Path) -> dict:
    out = {}
    try:
        out["decode_tok_s"] = llama_bench(args, bin_dir, gguf, [
            "-p", "0", "-n", str(args.output_len), "-d", str(args.prompt_len)])
        out["prefill_tok_s"] = llama_bench(args, bin_dir, gguf, [
            "-p", str(args.prefill_len), "-n", "0"])
        if args.depth:
            out["depth_decode_tok_s"] = llama_bench(args, bin_dir, gguf, [
                "-p", "0", "-n", "32", "-d", str(args.depth)])
        if args.batch:
            out["batch_tok_s"] = batched_bench(args, bin_dir, gguf)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        out["error"] = str(e)
    return out


def batched_bench(args: argparse.Namespace, bin_dir: Path, gguf: Path) -> float:
    """llama-batched-bench's output tok/s for --batch sequences of --prompt-len ->
    --output-len (its total time T covers prefill and decode: npl * ntg / T)."""
    npl = args.batch
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(args.threads),
           "-c", str(npl * (args.prompt_len + args.output_len) + 64), "-b", "2048", "-ub",
           "512", "-npp", str(args.prompt_len), "-ntg", str(args.output_len), "-npl", str(npl),
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(proc.stderr.strip()[-2000:])
    return npl * args.output_len / float(rows[-1]["t"])


def peak_rss_llamacpp(args: argparse.Namespace, bin_dir: Path, gguf: Path) -> float:
    """Peak RSS (MB) of a llama-bench decode run on the file, at kvserve's context."""
    rss: list[float] = []
    llama_bench(args, bin_dir, gguf, ["-p", "0", "-n", "16", "-d", str(args.prompt_len)], rss)
    return rss[0] if rss else float("nan")


def med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


KEYS = ("decode_tok_s", "prefill_tok_s", "depth_decode_tok_s", "batch_tok_s")


def bench_file(args: argparse.Namespace, bin_dir: Path, kind: str, gguf: Path) -> dict:
    nbytes = weight_bytes(gguf)
    runs: dict[str, list[dict]] = {"kvserve": [], "llama.cpp": []}
    bws = []
    for r in range(args.repeats):
        bws.append(read_bandwidth(nbytes, args.threads))
        order = ["kvserve", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "kvserve"]
        for engine in order:
            res = run_kvserve(args, gguf) if engine == "kvserve" \
                else run_llamacpp(args, bin_dir, gguf)
            if "error" in res:
                print(f"  {kind} {engine} failed: {res['error']}", file=sys.stderr)
            runs[engine].append(res)
    bw = statistics.median(bws)
    out = {"file": str(gguf), "weight_bytes": nbytes, "read_gb_s": bw, "read_all": bws,
           "llama_peak_rss_mb": peak_rss_llamacpp(args, bin_dir, gguf)}
    for engine, rs in runs.items():
        out[engine] = {k: med(rs, k) for k in KEYS + ("peak_rss_mb", "load_s")}
        out[engine]["all"] = rs
        dec = out[engine]["decode_tok_s"]
        out[engine]["bandwidth_fraction"] = dec * nbytes / (bw * 1e9) if dec else None
    k, ll = out["kvserve"], out["llama.cpp"]
    print(f"{kind} ({nbytes / 1e6:.0f} MB of weights; read {bw:.1f} GB/s "
          f"{[round(b, 1) for b in bws]}):")
    for key in KEYS:
        if k.get(key) and ll.get(key):
            print(f"  {key}: kvserve {k[key]:.1f} {[round(r.get(key, 0), 1) for r in k['all']]}"
                  f" / llama.cpp {ll[key]:.1f} {[round(r.get(key, 0), 1) for r in ll['all']]}"
                  f" = {k[key] / ll[key]:.2f}x")
    for engine in runs:
        frac = out[engine]["bandwidth_fraction"]
        if frac:
            print(f"  {engine} batch-1 decode at {frac:.0%} of the read bandwidth")
    print(f"  peak RSS: kvserve {k.get('peak_rss_mb') or 0:.0f} MB (load {k.get('load_s') or 0:.1f}"
          f" s), llama.cpp {out['llama_peak_rss_mb']:.0f} MB")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", type=Path, help="llama.cpp build (make_gguf_models.py's)")
    p.add_argument("--llama-bin-avx2", type=Path, help="an AVX2-only llama.cpp build/bin")
    p.add_argument("--shapes", default="llama-3.2-1b")
    p.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0")
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--kv8", action="store_true", help="int8 KV (kvserve) / q8_0 (llama.cpp)")
    p.add_argument("--llama-fa", choices=("auto", "on", "off"), default="auto",
                   help="llama-bench's flash attention (auto, its default, picks on for CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--depth", type=int, default=0, help="also decode at this context")
    p.add_argument("--batch", type=int, default=0,
                   help="also N prompts at once (against llama-batched-bench -npl N)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=Path)
    from kvserve.bench.record import add_record_arg

    add_record_arg(p, "quantized-gguf")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        real, sys.stdout = sys.stdout, sys.stderr
        result = worker(args)
        real.write(json.dumps(result) + "\n")
        return 0
    if args.llama_src is None:
        p.error("--llama-src is required")
    from kvserve.kernels.cpu.cpu_features import cpu_info

    info = cpu_info()
    print(f"CPU: {info.summary()}")
    print("flags: " + " ".join(sorted(f for f in info.flags if f.startswith(("avx", "fma")))))
    tree = make_gguf_models.llama_tree(args.llama_src)
    bin_dir = args.llama_bin_avx2 if args.isa == "avx2" else tree / "build" / "bin"
    if bin_dir is None:
        p.error("--isa avx2 needs --llama-bin-avx2")
    results = {"cpu": info.summary(), "isa": args.isa, "threads": args.threads,
               "kv8": args.kv8, "files": {}}
    for shape in args.shapes.split(","):
        files = make_gguf_models.ensure(args.llama_src, shape, args.types.split(","))
        for kind, path in files.items():
            results["files"][f"{shape} {kind}"] = bench_file(args, bin_dir, f"{shape} {kind}",
                                                             path)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.record:
        record(args, results)
    return 0


# Issue 48's targets per figure (acceptance 1 and 2): kvserve / llama.cpp
TARGETS = {"decode_tok_s": 1.1, "prefill_tok_s": 1.5, "depth_decode_tok_s": 1.1,
           "batch_tok_s": 1.5}
LABELS = {"decode_tok_s": "batch-1 decode", "prefill_tok_s": "prefill",
          "depth_decode_tok_s": "batch-1 decode at depth", "batch_tok_s": "batch"}


def record(args: argparse.Namespace, results: dict) -> None:
    """The figures page's record: every file's figures beside llama.cpp's, with the targets."""
    from kvserve.bench.record import Row, ratio, write_record

    rows = []
    sizes = {"prefill_tok_s": args.prefill_len, "depth_decode_tok_s": args.depth,
             "batch_tok_s": args.batch, "decode_tok_s": args.prompt_len}
    for name, out in results["files"].items():
        for key in KEYS:
            k, ll = out["kvserve"].get(key), out["llama.cpp"].get(key)
            if not k or not ll:
                continue
            target = TARGETS[key]
            rows.append(Row(f"{name} {LABELS[key]} ({sizes[key]})", "tok/s", round(k, 1),
                            round(ll, 1), ratio(k, ll), f">= {target}x", k >= target * ll))
    kv = "int8 KV vs q8_0" if args.kv8 else "float KV vs f16"
    write_record(args.record, name=f"gguf-scale-{args.isa}-{args.shapes.replace(',', '-')}",
                 rows=rows, title=f"GGUF files against llama.cpp, {args.isa} ({kv})",
                 peer="llama.cpp (llama-bench / llama-batched-bench, built from "
                 f"{args.llama_src}), the same files", notes=f"medians of {args.repeats}, "
                 f"engines alternating, {args.threads} threads.")


if __name__ == "__main__":
    sys.exit(main())
