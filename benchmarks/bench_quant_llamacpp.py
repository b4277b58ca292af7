#!/usr/bin/env python
"""Quantized GGUF weights on the CPU: kvserve vs llama.cpp on the same files, side by side
(issue 31's acceptance 1 and 2).

Files: the embedded SmolLM2-135M-Instruct Q4_1 (the PyPI package's), and Q8_0 and Q4_K_M
files made from the same checkpoint by llama.cpp's own `llama-quantize` (the Q4_1 file
requantized to F32 once, then F32 -> each type; kept under the benchmark cache). For each file:

- batch 1, --prompt-len random token ids -> --output-len greedy tokens, 2 threads: kvserve
  (LLM on the GGUF file, its default quantization keeping the blocks) and llama.cpp
  (llama-cpp-python's `Llama` on the same file and token ids: bench_llamacpp.py's worker),
  alternating, --repeats times; decode tok/s medians and their ratio; then the same with one
  competing single-threaded busy process (`--contention`), and the fraction of its quiet
  decode speed each engine keeps;
- batch --batch (default 32) x the same lengths: kvserve's output tok/s (one `generate` of
  all prompts) against `llama-batched-bench` (-npp/-ntg/-npl, its own figures: total time T
  for prefill + decode of every sequence; output tok/s = npl * ntg / T).

llama-cpp-python needs no build of its own: its sdist's Python package runs on the libllama.so
of the llama.cpp build (LLAMA_CPP_LIB_PATH).

GGML_NATIVE=ON builds for the build machine's CPU. On a VM whose CPU reports AMX (Sapphire
Rapids), that build died with SIGILL in llama-bench and a segfault in llama-cpp-python.
Build there with -DGGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/AVX512/AVX512_VNNI/AVX512_VBMI/
AVX512_BF16 ON and GGML_AMX_TILE/INT8/BF16 OFF. On AMD EPYC (AVX-512, no AMX) the native
build runs.

Set-up, once (nice the build on a shared machine; minutes):
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llsrc
    tar xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
    cd /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build \\
        -j2 --target llama-bench llama-batched-bench llama-perplexity llama-quantize
    python3 -m venv /tmp/lcpp && /tmp/lcpp/bin/pip install numpy typing_extensions diskcache jinja2

Run:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_llamacpp.py \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36 --repeats 3 --contention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_throughput as bt  # noqa: E402

BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"


def cpu_line() -> str:
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


def gguf_vocab_size(path: str) -> int:
    """The file's vocabulary (prompts are random ids below it; every file here shares it)."""
    import gguf

    return len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)


def worker_kvserve(args: argparse.Namespace) -> dict:
    """One kvserve run in this (fresh) process: bench_throughput's worker on the GGUF file."""
    prompts = json.loads(Path(args.prompt_file).read_text())
    ns = argparse.Namespace(model=args.gguf, dtype="float32", threads=args.threads,
                            num_prompts=len(prompts), prompt_len=len(prompts[0]),
                            max_tokens=args.output_len, engine="kvserve", profile=None,
                            no_split=True, kv_control=False, kv_cache_report=False)
    return bt.worker_kvserve(ns, prompts)


def run_sub(cmd: list[str], env: dict, timeout: float) -> dict:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": "\n".join(proc.stderr.strip().splitlines()[-15:])}
    return json.loads(lines[-1])


class Competitor:
    """One single-threaded busy process for the duration of a `with` block (or nothing)."""

    def __init__(self, on: bool) -> None:
        self.on, self.proc = on, None

    def __enter__(self):
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", BUSY])
            time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        return False


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        src = Path(args.llama_src)
        self.bin = src / "vendor" / "llama.cpp" / "build" / "bin"
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                        MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        self.llama_env = dict(self.env, PYTHONPATH=str(src), LLAMA_CPP_LIB_PATH=str(self.bin))

    def kvserve(self, gguf: str, prompt_file: Path) -> dict:
        a = self.args
        return run_sub([sys.executable, __file__, "--worker", "kvserve", "--gguf", gguf,
                        "--prompt-file", str(prompt_file), "--threads", str(a.threads),
                        "--output-len", str(a.output_len)], self.env, a.timeout)

    def llamacpp(self, gguf: str, prompt_file: Path) -> dict:
        """bench_llamacpp.py's worker: one prompt (the first of the file's list)."""
        a = self.args
        one = prompt_file.with_suffix(".first.json")
        one.write_text(json.dumps(json.loads(prompt_file.read_text())[0]))
        return run_sub([a.llama_python, str(BENCH_DIR / "bench_llamacpp.py"), "--worker",
                        "llamacpp", "--gguf", gguf, "--prompt-file", str(one),
                        "--threads", str(a.threads), "--output-len", str(a.output_len)],
                       self.llama_env, a.timeout)

    def batched_bench(self, gguf: str, npl: int) -> dict:
        a = self.args
        ctx = npl * (a.prompt_len + a.output_len) + 64
        cmd = [str(self.bin / "llama-batched-bench"), "-m", gguf, "-t", str(a.threads),
               "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(a.prompt_len),
               "-ntg", str(a.output_len), "-npl", str(npl), "--output-format", "jsonl"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                              env=self.env)
        rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not rows:
            return {"error": proc.stderr.strip()[-1500:]}
        r = rows[-1]
        return {"tok_s": npl * a.output_len / r["t"], "raw": r}

    def make_files(self) -> dict[str, str]:
        """The files by name: Q4_1 (embedded), Q8_0 and Q4_K_M made by llama-quantize."""
        from kvserve.model_loader.default import embedded_model_path

        base = str(embedded_model_path())
        files = {"Q4_1": base}
        cache = bt.cache_dir()
        f32 = cache / "smollm2-135m-instruct-F32.gguf"
        quantize = str(self.bin / "llama-quantize")
        if not f32.is_file():
            subprocess.run([quantize, "--allow-requantize", base, str(f32), "F32"], check=True,
                           capture_output=True)
        for kind in self.args.files.split(","):
            if kind == "Q4_1":
                continue
            out = cache / f"smollm2-135m-instruct-{kind}.gguf"
            if not out.is_file():
                subprocess.run([quantize, str(f32), str(out), kind], check=True,
                               capture_output=True)
            files[kind] = str(out)
        return {k: files[k] for k in self.args.files.split(",")}


def med(rs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rs if "error" not in r and key in r]
    return statistics.median(vals) if vals else None


def batch1(bench: Bench, name: str, gguf: str, prompt_file: Path, contention: bool) -> dict:
    runs: dict[str, list[dict]] = {"kvserve": [], "llama.cpp": []}
    fns = [("kvserve", bench.kvserve), ("llama.cpp", bench.llamacpp)]
    for r in range(bench.args.repeats):
        for engine, fn in (fns if r % 2 == 0 else fns[::-1]):
            with Competitor(contention), bt.Interference() as noise:
                res = fn(gguf, prompt_file)
            res["foreign_cores"] = noise.result.get("foreign_cores")
            runs[engine].append(res)
            if "error" in res:
                print(f"  {engine} failed: {res['error']}", file=sys.stderr)
    out = {e: {"decode_tok_s": med(rs, "decode_tok_s"), "ttft_s": med(rs, "ttft_s"),
               "all": [r.get("decode_tok_s") for r in rs]} for e, rs in runs.items()}
    firsts = [rs[0].get("first_outputs", [[]])[0] for rs in runs.values()]
    out["greedy_common_prefix"] = bt.common_prefix(*firsts)
    tag = "with a busy process" if contention else "quiet"
    k, ll = out["kvserve"]["decode_tok_s"], out["llama.cpp"]["decode_tok_s"]
    line = f"  {name} batch 1 {tag}: kvserve {k or 0:.1f} tok/s " \
           f"{[round(x or 0, 1) for x in out['kvserve']['all']]}, llama.cpp {ll or 0:.1f} " \
           f"{[round(x or 0, 1) for x in out['llama.cpp']['all']]}"
    if k and ll:
        out["ratio"] = k / ll
        line += f" -> {k / ll:.2f}x"
    print(line + f"; greedy tokens agree for {out['greedy_common_prefix']} of "
          f"{bench.args.output_len}", flush=True)
    return out


def batched(bench: Bench, name: str, gguf: str, prompt_file: Path, npl: int) -> dict:
    runs: dict[str, list[dict]] = {"kvserve": [], "llama.cpp": []}
    for r in range(bench.args.repeats):
        order = [("kvserve", lambda: bench.kvserve(gguf, prompt_file)),
                 ("llama.cpp", lambda: bench.batched_bench(gguf, npl))]
        for engine, fn in (order if r % 2 == 0 else order[::-1]):
            res = fn()
            runs[engine].append(res)
            if "error" in res:
                print(f"  {engine} failed: {res['error']}", file=sys.stderr)
    out = {e: {"tok_s": med(rs, "tok_s"), "all": [x.get("tok_s") for x in rs]}
           for e, rs in runs.items()}
    k, ll = out["kvserve"]["tok_s"], out["llama.cpp"]["tok_s"]
    line = f"  {name} batch {npl}: kvserve {k or 0:.1f} output tok/s " \
           f"{[round(x or 0, 1) for x in out['kvserve']['all']]}, llama-batched-bench " \
           f"{ll or 0:.1f} {[round(x or 0, 1) for x in out['llama.cpp']['all']]}"
    if k and ll:
        out["ratio"] = k / ll
        line += f" -> {k / ll:.2f}x"
    print(line, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", default="/tmp/llsrc/llama_cpp_python-0.3.36",
                   help="llama-cpp-python's sdist, its vendor/llama.cpp built (see above)")
    p.add_argument("--llama-python", default="/tmp/lcpp/bin/python")
    p.add_argument("--files", default="Q4_1,Q8_0,Q4_K_M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="the batched workload; 0: skip it")
    p.add_argument("--contention", action="store_true",
                   help="also batch 1 beside one single-threaded busy process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--worker", choices=["kvserve"], help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        real, sys.stdout = sys.stdout, sys.stderr
        try:
            result = worker_kvserve(args)
        finally:
            sys.stdout = real
        print(json.dumps(result))
        return 0

    bench = Bench(args)
    files = bench.make_files()
    print(f"cpu: {cpu_line()}; {args.threads} threads; load average {os.getloadavg()[0]:.1f}")
    results: dict = {"cpu": cpu_line(), "files": files}
    vocab = gguf_vocab_size(next(iter(files.values())))
    one = bt.make_prompts(1, args.prompt_len, vocab, args.seed)
    many = bt.make_prompts(args.batch, args.prompt_len, vocab, args.seed) if args.batch else []
    pf1 = bt.cache_dir() / f".bench-quant-prompt1-{os.getpid()}.json"
    pfn = bt.cache_dir() / f".bench-quant-prompts-{os.getpid()}.json"
    pf1.write_text(json.dumps(one))
    pfn.write_text(json.dumps(many))
    try:
        for name, gguf in files.items():
            size = Path(gguf).stat().st_size / 1e6
            print(f"\n{name}: {gguf} ({size:.1f} MB)", flush=True)
            res = {"quiet": batch1(bench, name, gguf, pf1, False)}
            if args.contention:
                res["busy"] = batch1(bench, name, gguf, pf1, True)
                kept = {}
                for e in ("kvserve", "llama.cpp"):
                    q, b = res["quiet"][e]["decode_tok_s"], res["busy"][e]["decode_tok_s"]
                    kept[e] = b / q if q and b else None
                res["kept"] = kept
                print(f"  {name} fraction of quiet batch-1 speed kept beside a busy process: "
                      + ", ".join(f"{e} {v:.2f}" for e, v in kept.items() if v), flush=True)
            if args.batch:
                res[f"batch{args.batch}"] = batched(bench, name, gguf, pfn, args.batch)
            results[name] = res
    finally:
        for f in (pf1, pfn, pf1.with_suffix(".first.json")):
            f.unlink(missing_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
