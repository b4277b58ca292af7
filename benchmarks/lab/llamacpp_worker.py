"""llama-cpp-python's side of the llama.cpp comparisons (benchmarks/lab/llamacpp.py), run as a
script by llama.cpp's own interpreter: it imports neither torch nor kvserve, so the peer runs
as its users run it. Prints one JSON object.

    PYTHON llamacpp_worker.py generate --job JOB.json --threads N   # {gguf, prompt, output_len}
    PYTHON llamacpp_worker.py nll --job JOB.json --threads N        # {gguf, context, windows,
                                                                    #  texts, extra_bufts}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def generate(job: dict, threads: int) -> dict:
    """Greedy tokens of one prompt (token ids, no BOS added) after a short warm-up, with the
    time to the first token and the decode rate after it."""
    import llama_cpp
    from llama_cpp import Llama

    prompt, n = job["prompt"], job["output_len"]
    llm = Llama(model_path=job["gguf"], n_threads=threads, n_threads_batch=threads,
                n_ctx=len(prompt) + n + 16, n_batch=512, verbose=False)

    def run(tokens: list[int], count: int) -> tuple[list[int], float, float, float]:
        out: list[int] = []
        t0 = t_first = time.perf_counter()
        for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if not out:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) == count:
                break
        return out, t0, t_first, time.perf_counter()

    run(prompt[:8], 4)  # warm-up
    tokens, t0, t_first, t_end = run(prompt, n)
    return {"engine": "llama.cpp", "version": llama_cpp.__version__, "wall_s": t_end - t0,
            "tok_s": len(tokens) / (t_end - t0), "ttft_s": t_first - t0,
            "decode_tok_s": (len(tokens) - 1) / (t_end - t_first), "first_outputs": [tokens]}


def no_extra_buffer_types(llama_cpp) -> None:
    """llama.cpp's AMX path is an "extra buffer type" (weights repacked for tiles). On a VM
    whose kernel does not grant the tile state its first tile instruction is SIGILL; without
    extra buffer types the dot products run on AVX-512/AVX2 instead."""
    defaults = llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params


def window_nll(scores, window: list[int]) -> tuple[float, list[int]]:
    """The NLL of window[1:] given row i of `scores` ([len - 1, vocab] logits) predicting
    token i + 1, in float64, and each row's most likely token."""
    import numpy as np

    logits = np.asarray(scores, dtype=np.float64)
    top1 = logits.argmax(axis=1).tolist()
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -float(logp[np.arange(len(window) - 1), window[1:]].sum()), top1


def nll(job: dict, threads: int) -> dict:
    """The NLL of every window through llama.cpp's kernels, and its tokenization of texts."""
    import llama_cpp
    from llama_cpp import Llama

    if not job.get("extra_bufts"):
        no_extra_buffer_types(llama_cpp)
    llm = Llama(model_path=job["gguf"], n_ctx=job["context"], n_batch=job["context"],
                n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    total, tokens, top1 = 0.0, 0, []
    t0 = time.perf_counter()
    for win in job["windows"]:
        llm.reset()
        llm.eval(win)
        value, best = window_nll(llm.scores[: len(win) - 1], win)
        total, tokens = total + value, tokens + len(win) - 1
        top1.append(best)
    seconds = time.perf_counter() - t0
    toks = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in job["texts"]]
    return {"nll": total, "tokens": tokens, "seconds": seconds, "tokenized": toks, "top1": top1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("generate", "nll"))
    p.add_argument("--job", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    job = json.loads(args.job.read_text())
    print(json.dumps((generate if args.mode == "generate" else nll)(job, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
