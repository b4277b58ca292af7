"""llama.cpp as a benchmark peer: its own tools (`llama-bench`, `llama-batched-bench`), run on a
GGUF file, their JSON lines parsed; and llama-cpp-python (in its own interpreter, no torch, no
kvserve) running `llamacpp_worker.py` beside this module for what the tools do not report
(greedy tokens of one prompt, the log-probabilities of given windows).

One place for what the peer comparisons under benchmarks/ share, so each comparison states
only its workload (issue 51)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.lab.harness import worker_env

WORKER = Path(__file__).with_name("llamacpp_worker.py")

# runs argv[1:] and prints the peak RSS of that child alone (its own RUSAGE_CHILDREN)
_RSS_WRAPPER = ("import resource, subprocess, sys\n"
                "rc = subprocess.run(sys.argv[1:]).returncode\n"
                "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
                " file=sys.stderr)\n"
                "sys.exit(rc)\n")


def bin_dir(llama_src: Path) -> Path:
    """build/bin of the llama.cpp tree in a llama-cpp-python sdist (or of the tree itself)."""
    from benchmarks.lab.gguf_models import llama_tree

    return llama_tree(Path(llama_src)) / "build" / "bin"


def python_env(llama_src: str | Path | None, threads: int,
               lib_dir: str | Path | None = None) -> dict[str, str]:
    """The environment of llama-cpp-python's interpreter: the project's PYTHONPATH dropped;
    with `llama_src` (an sdist), its Python package on that build's libllama.so, so no pip
    build is needed; `lib_dir` picks another build's libllama.so (an AVX2-only one)."""
    env = worker_env(threads)
    env.pop("PYTHONPATH", None)
    if llama_src:
        env["PYTHONPATH"] = str(llama_src)
        env["LLAMA_CPP_LIB_PATH"] = str(bin_dir(Path(llama_src)))
    if lib_dir:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return env


def run_tool(cmd: list[str], timeout: float, env: dict[str, str] | None = None
             ) -> tuple[list[dict], str]:
    """Run one of llama.cpp's tools with JSON-lines output: (its rows, its stderr); a failed
    run or one without rows raises RuntimeError with the tail of its stderr."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, env=env)
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{Path(cmd[0]).name} exit code {proc.returncode}: "
                           f"{proc.stderr.strip()[-1500:]}")
    return rows, proc.stderr


def llama_bench(bins: Path, gguf: str | Path, threads: int, extra: list[str], timeout: float,
                rss: list[float] | None = None) -> float:
    """tokens/s of one `llama-bench` test (`extra`: its -p/-n/-d and cache flags; -r 1, its
    own average); with `rss`, the run's peak RSS (MB) is appended to it."""
    cmd = [bins / "llama-bench", "-m", gguf, "-t", str(threads), "-r", "1", "-o", "jsonl",
           *extra]
    if rss is not None:
        cmd = [sys.executable, "-c", _RSS_WRAPPER, *cmd]
    rows, err = run_tool(cmd, timeout)
    if rss is not None:
        rss += [int(ln.split()[1]) / 1024 for ln in err.splitlines() if ln.startswith("MAXRSS ")]
    return float(rows[-1]["avg_ts"])


def batched_bench(bins: Path, gguf: str | Path, threads: int, prompt_len: int, output_len: int,
                  npl: int, timeout: float, env: dict[str, str] | None = None) -> float:
    """Output tok/s of `llama-batched-bench` for `npl` sequences of prompt_len -> output_len:
    its total time T covers prefill and decode of every sequence, so npl * ntg / T."""
    ctx = npl * (prompt_len + output_len) + 64
    rows, _ = run_tool([bins / "llama-batched-bench", "-m", gguf, "-t", str(threads), "-c",
                        str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg",
                        str(output_len), "-npl", str(npl), "--output-format", "jsonl"],
                       timeout, env)
    return npl * output_len / float(rows[-1]["t"])


def worker_cmd(python: str, mode: str, job: Path, threads: int) -> list[str]:
    """llama-cpp-python's side of a comparison: `mode` (generate, nll) on the job file."""
    return [python, str(WORKER), mode, "--job", str(job), "--threads", str(threads)]
