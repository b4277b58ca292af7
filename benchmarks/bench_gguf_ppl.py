#!/usr/bin/env python
"""Perplexity of one GGUF file through kvserve and through llama.cpp, on the same tokens.

The file (default: the embedded SmolLM2-135M-Instruct, Q4_1) is scored on English and code text
found on the machine (kvserve.eval.corpus: license texts, package descriptions, the stdlib's
held-out split), cut into non-overlapping windows of --context tokens; every token of a window
but its first is predicted from those before it. kvserve reads the file with its own GGUF
loader (its default quantization: the projections kept in the file's block formats, run by the
quantized kernels; `--quantization none` dequantizes to float32) and scores through the
engine's prompt logprobs; llama.cpp (llama-cpp-python, in its own venv: no torch, no kvserve)
evaluates the same token ids with `logits_all` and its own kernels. Both tokenizations of the
text are compared too (llama.cpp's tokenizer on the same documents). Target: within 0.5%.

Set-up, once (llama-cpp-python builds from source, minutes; nice it on a shared machine):
    python3 -m venv /tmp/lcpp && nice /tmp/lcpp/bin/pip install numpy llama-cpp-python==0.3.36
or, with llama.cpp built from the sdist (bench_quant_llamacpp.py's set-up), pass --llama-src:
its Python package runs on that build's libllama.so.

Run:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_gguf_ppl.py --llama-python /tmp/lcpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker_llamacpp(args: argparse.Namespace) -> dict:
    """Under the llama.cpp venv's python: the NLL of every window, and its tokenization of
    the documents' texts."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    job = json.loads(Path(args.job).read_text())
    if not job["extra_bufts"]:
        # llama.cpp's AMX path is an "extra buffer type" (weights repacked for tiles). On a VM
        # whose kernel does not grant the tile state, its first tile instruction is SIGILL;
        # without extra buffer types the Q4_1 dot products run on AVX-512/AVX2 instead.
        defaults = llama_cpp.llama_model_default_params

        def no_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = no_extra_bufts
        llama_cpp.llama.llama_cpp.llama_model_default_params = no_extra_bufts
    llm = Llama(model_path=job["gguf"], n_ctx=job["context"], n_batch=job["context"],
                n_threads=job["threads"], n_threads_batch=job["threads"], logits_all=True,
                verbose=False)
    nll, tokens, top1 = 0.0, 0, []
    t0 = time.perf_counter()
    for win in job["windows"]:
        llm.reset()
        llm.eval(win)
        logits = np.asarray(llm.scores[: len(win) - 1], dtype=np.float64)
        top1.append(logits.argmax(axis=1).tolist())
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(win) - 1), win[1:]].sum())
        tokens += len(win) - 1
    seconds = time.perf_counter() - t0
    toks = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in job["texts"]]
    return {"nll": nll, "tokens": tokens, "seconds": seconds, "tokenized": toks, "top1": top1}


def run_llamacpp(args: argparse.Namespace, gguf: str, wins: list[list[int]], texts: list[str],
                 lib_dir: str | None) -> dict:
    """worker_llamacpp in llama.cpp's python, on the libllama.so in `lib_dir` where given."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if args.llama_src:
        env["PYTHONPATH"] = args.llama_src
        env["LLAMA_CPP_LIB_PATH"] = f"{args.llama_src}/vendor/llama.cpp/build/bin"
    if lib_dir:
        env["LLAMA_CPP_LIB_PATH"] = lib_dir
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": gguf, "context": args.context,
                                   "threads": args.threads, "windows": wins,
                                   "extra_bufts": args.llama_extra_bufts, "texts": texts}))
        subprocess.run([args.llama_python, __file__, "--worker", "--job", str(job),
                        "--out", str(out)], check=True, env=env)
        return json.loads(out.read_text())


def agreement(a, b) -> float:
    """The fraction of positions where two engines' most likely next tokens are the same."""
    pairs = [(x, y) for wa, wb in zip(a, b) for x, y in zip(wa, wb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--llama-python", default="/tmp/lcpp/bin/python")
    p.add_argument("--llama-src", default=None,
                   help="llama-cpp-python's sdist with vendor/llama.cpp/build (no pip build)")
    p.add_argument("--quantization", default=None, help="kvserve's (default: the file's)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--windows", type=int, default=16, help="per kind (English, code)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-extra-bufts", action="store_true",
                   help="let llama.cpp repack weights (its AMX path; SIGILL where the kernel "
                   "grants no tile state)")
    p.add_argument("--kv-cache-dtype", default=None, help="kvserve's (default: float32)")
    p.add_argument("--top1-avx2-lib", default=None,
                   help="also the next-token top-1 agreement with llama.cpp, beside that of "
                   "the llama.cpp build whose libllama.so is in this directory (an AVX2-only "
                   "build) with the default build")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker_llamacpp(args)))
        return 0

    from kvserve.eval.corpus import KINDS, describe, document_windows, documents
    from kvserve.eval.perplexity import engine_nll
    from kvserve.model_loader.default import embedded_model_path
    from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
    from kvserve.tokenizer import Tokenizer

    gguf = args.gguf or str(embedded_model_path())
    tok = Tokenizer.from_dir(tokenizer_dir(gguf))
    print(cpu_line())
    print(f"model {gguf}; windows of {args.context} tokens, {args.windows} per kind")
    label = f"quantization {args.quantization or 'default'}"
    ok = True
    for kind in KINDS:
        docs = documents(kind)
        windows = document_windows(tok, docs, args.context, args.windows)
        wins = [w.tokens for w in windows]
        texts = [d.text for d in docs[:8]]
        t0 = time.perf_counter()
        kv = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
        ours = engine_nll(gguf, wins, dtype="float32", quantization=args.quantization,
                          top1=bool(args.top1_avx2_lib), **kv)
        ours_s = time.perf_counter() - t0
        theirs = run_llamacpp(args, gguf, wins, texts, None)
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
        print(f"  tokenization of {len(texts)} documents identical to llama.cpp's: "
              f"{same_tok} of {len(texts)}")
        if args.top1_avx2_lib:
            avx2 = run_llamacpp(args, gguf, wins, texts, args.top1_avx2_lib)
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
