#!/usr/bin/env python
"""Batch 1 on the CPU: kvserve vs llama.cpp (llama-cpp-python) on the same model, side by side.

The reference model of bench_throughput.py (fp32 safetensors) and the same weights as an f32
GGUF made by llama.cpp's own convert_hf_to_gguf.py; 1 prompt of --prompt-len random token ids
-> --output-len greedy tokens, each engine in its own subprocess (llama.cpp in its own venv,
so it never touches the project's), alternating, --repeats times; prints medians, the ratio,
whether the greedy tokens agree, and the fraction of the in-run memory-bandwidth limit each
engine's decode reaches: fp32 weights read once per token / the measured read bandwidth of a
buffer of the weights' size after a warm pass (where the weights fit in L3, as the reference
model's 156 MB do in a 260 MiB L3, that is L3 bandwidth, not DRAM; the DRAM copy figure is
printed too).

Set-up, once (llama-cpp-python builds from source; nice it on a shared machine):
    python3 -m venv /work/llamacpp-venv
    nice /work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llsrc
    tar xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc   # convert script + gguf-py
    pip install --target /tmp/sp sentencepiece   # the convert script imports it; kept apart

Run:
    PYTHONPATH=$PWD:/tmp/sp .venv/bin/python benchmarks/bench_llamacpp.py \\
        --convert-from /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def worker_llamacpp(args: argparse.Namespace) -> dict:
    """Runs under the llama.cpp venv's python: no torch, no kvserve."""
    from llama_cpp import Llama

    prompt = json.loads(Path(args.prompt_file).read_text())
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=len(prompt) + args.output_len + 16, n_batch=512, verbose=False)

    def generate(tokens: list[int], n: int) -> tuple[list[int], float, float, float]:
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if not out:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) == n:
                break
        return out, t0, t_first, time.perf_counter()

    generate(prompt[:8], 4)  # warm-up
    tokens, t0, t_first, t_end = generate(prompt, args.output_len)
    import llama_cpp

    return {"engine": "llama.cpp", "version": llama_cpp.__version__, "wall_s": t_end - t0,
            "tok_s": len(tokens) / (t_end - t0), "ttft_s": t_first - t0,
            "decode_tok_s": (len(tokens) - 1) / (t_end - t_first),
            "first_outputs": [tokens]}


def convert(src_dir: Path, model_dir: Path, gguf: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (f32). The reference model's tokenizer is a locally
    made BPE whose pre-tokenizer llama.cpp does not recognise; it is declared "qwen2" (this
    benchmark feeds token ids, so the pre-tokenizer never runs)."""
    shim = (
        "import runpy, sys\n"
        f"root = {str(src_dir)!r}\n"
        "sys.path[:0] = [root, root + '/gguf-py']\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    tmp = gguf.with_suffix(".tmp")
    subprocess.run([sys.executable, "-c", shim, str(model_dir), "--outtype", "f32",
                    "--outfile", str(tmp)], check=True)
    tmp.rename(gguf)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    p.add_argument("--gguf", help="f32 GGUF of the reference model (default: next to it)")
    p.add_argument("--convert-from", type=Path,
                   help="llama.cpp source dir (convert_hf_to_gguf.py): make the GGUF if missing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--worker", choices=["llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        real = sys.stdout
        sys.stdout = sys.stderr
        try:
            result = worker_llamacpp(args)
        finally:
            sys.stdout = real
        print(json.dumps(result))
        return 0

    sys.path.insert(0, str(BENCH_DIR))
    import bench_throughput as bt

    from kvserve.kernels.cpu.cpu_features import cpu_info

    model_dir = bt.ensure_checkpoint(bt.cache_dir() / "bench-qwen2-small", args.timeout)
    gguf = Path(args.gguf) if args.gguf else model_dir.parent / "bench-qwen2-small-f32.gguf"
    if not gguf.is_file():
        if args.convert_from is None:
            p.error(f"{gguf} is missing: pass --convert-from LLAMA_CPP_DIR (or --gguf)")
        convert(args.convert_from, model_dir, gguf)
    params = bt.param_counts(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = bt.make_prompts(1, args.prompt_len, vocab, args.seed)[0]
    prompt_file = gguf.parent / f".bench-llamacpp-prompt-{os.getpid()}.json"
    prompt_file.write_text(json.dumps(prompt))

    def run_kvserve() -> dict:
        return bt.run_worker(["bench", "--engine", "kvserve", "--dtype", "float32", "--model",
                              str(model_dir), "--num-prompts", "1", "--prompt-len",
                              str(args.prompt_len), "--max-tokens", str(args.output_len),
                              "--seed", str(args.seed)], args.threads, args.timeout)

    def run_llamacpp() -> dict:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        env.pop("PYTHONPATH", None)
        cmd = [args.llamacpp_python, __file__, "--worker", "llamacpp", "--gguf", str(gguf),
               "--prompt-file", str(prompt_file), "--threads", str(args.threads),
               "--output-len", str(args.output_len)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=env, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            return {"error": proc.stderr.strip()[-2000:]}
        return json.loads(lines[-1])

    runs: dict[str, list[dict]] = {"kvserve": [], "llama.cpp": []}
    ceiling_argv = ["ceiling", "--read-bytes", str(bt.weight_bytes(params))]
    ceilings = [bt.run_worker(ceiling_argv, args.threads, args.timeout)]
    load = [os.getloadavg()[0]]
    try:
        for r in range(args.repeats):
            order = [("kvserve", run_kvserve), ("llama.cpp", run_llamacpp)]
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                with bt.Interference() as noise:
                    res = fn()
                res["foreign_cores"] = noise.result.get("foreign_cores")
                runs[name].append(res)
                if "error" in res:
                    print(f"{name} failed: {res['error']}", file=sys.stderr)
        ceilings.append(bt.run_worker(ceiling_argv, args.threads, args.timeout))
        load.append(os.getloadavg()[0])
    finally:
        prompt_file.unlink(missing_ok=True)

    machine = bt.machine_ceilings([c for c in ceilings if "error" not in c], params, 1,
                                  args.prompt_len, args.output_len)
    print(f"\nkvserve vs llama.cpp, 1 x {args.prompt_len} -> {args.output_len}, float32, "
          f"{args.threads} threads, {args.repeats} repeats (median [min-max])")
    print(f"cpu: {cpu_info().summary()}; load average {load[0]:.1f} at start, "
          f"{load[-1]:.1f} at end")
    summary: dict = {"machine": machine, "load": load}
    for name, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        if not ok:
            print(f"  {name:<10} FAILED")
            continue
        stats = {k: bt.summarize([x[k] for x in ok]) for k in ("tok_s", "decode_tok_s", "ttft_s")}
        summary[name] = stats
        frac = ""
        if "batch1_limit_tok_s" in machine:
            frac = (f" = {100 * stats['decode_tok_s']['median'] / machine['batch1_limit_tok_s']:.1f}"
                    "% of the bandwidth limit")
        others = max((x.get("foreign_cores") or 0.0) for x in ok)
        print(f"  {name:<10} tok/s {bt.fmt_stat(stats['tok_s'])}, decode tok/s "
              f"{bt.fmt_stat(stats['decode_tok_s'])}{frac}, TTFT "
              f"{1000 * stats['ttft_s']['median']:.1f} ms, others <= {others:.2f} cores")
    if "kvserve" in summary and "llama.cpp" in summary:
        for key in ("tok_s", "decode_tok_s"):
            ratio = summary["kvserve"][key]["median"] / summary["llama.cpp"][key]["median"]
            summary[f"ratio_{key}"] = ratio
            print(f"  kvserve / llama.cpp {key}: {ratio:.2f}x")
        a = runs["kvserve"][0]["first_outputs"][0]
        b = runs["llama.cpp"][0]["first_outputs"][0]
        common = bt.common_prefix(a, b)
        summary["greedy_common_prefix"] = common
        print(f"  greedy agreement: common prefix {common} of {args.output_len} tokens")
    if "batch1_limit_tok_s" in machine:
        print(f"  bandwidth limit: {bt.describe_bandwidth_limit(machine)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs,
                                               "ceilings": ceilings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
