#!/usr/bin/env python
"""How long the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) takes to be ready,
whole process, kvserve beside llama.cpp on the same file, in one run.

Three starts, taken in turn (A B C A B C ...) after one uncounted start of each (the first start
of a machine writes kvserve's GGUF index, sidecar and GEMM measurement; the issue's figure is
every start after it):
- kvserve `LLM()`: `python -c "from kvserve import LLM; LLM()"`, from exec to exit;
- llama.cpp: `Llama(model_path=...)` in llama-cpp-python's own venv (no torch), exec to exit;
- `kvserve serve`: from exec to the first 200 from /health (then SIGTERM, and its exit waited).

Medians are quoted, with min-max, and the ratios kvserve / llama.cpp. llama.cpp keeps its
weights quantized and needs no packing, so it is the floor, not a like-for-like rival; torch's
import alone is ~1.8 s here.

Set-up of llama.cpp (once; builds from source): see bench_gguf_ppl.py.
Run:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_startup.py --llama-python /tmp/lcpp/bin/python
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

LLAMA = """
import llama_cpp
defaults = llama_cpp.llama_model_default_params
def no_extra_bufts():  # AMX repacking is SIGILL on VMs without the tile state (bench_gguf_ppl)
    p = defaults()
    p.use_extra_bufts = False
    return p
llama_cpp.llama_model_default_params = no_extra_bufts
llama_cpp.llama.llama_cpp.llama_model_default_params = no_extra_bufts
llama_cpp.Llama(model_path={path!r}, n_ctx=8192, n_threads={threads}, verbose=False)
"""


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_process(argv: list[str], timeout: float) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall


def time_serve(python: str, timeout: float) -> float:
    """exec of `kvserve serve` -> the first 200 from /health."""
    port = free_port()
    t0 = time.perf_counter()
    script = Path(python).parent / "kvserve"  # the console script a user runs
    argv = [str(script)] if script.exists() else [python, "-m", "kvserve.cli"]
    proc = subprocess.Popen([*argv, "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited {proc.returncode} before /health")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"/health did not answer within {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--llama-python", help="python of a venv with llama-cpp-python")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()

    from kvserve.model_loader.default import embedded_model_path

    gguf = str(embedded_model_path())
    starts = {
        "kvserve LLM()": lambda: time_process(
            [sys.executable, "-c", "from kvserve import LLM; LLM()"], args.timeout),
        "kvserve serve -> /health": lambda: time_serve(sys.executable, args.timeout),
    }
    if args.llama_python:
        code = LLAMA.format(path=gguf, threads=args.threads)
        starts["llama.cpp Llama()"] = lambda: time_process([args.llama_python, "-c", code],
                                                           args.timeout)
    print(cpu_line())
    print(f"model: {Path(gguf).name}; load average before: {os.getloadavg()[0]:.2f}")
    for start in starts.values():  # uncounted: the first start of the machine
        start()
    walls: dict[str, list[float]] = {name: [] for name in starts}
    for _ in tqdm(range(args.runs), desc="rounds"):
        for name, start in starts.items():
            walls[name].append(start())
    print(f"load average after: {os.getloadavg()[0]:.2f}; {args.runs} runs each, whole process")
    for name, xs in walls.items():
        print(f"  {name:<26} {spread(xs)}")
    if "llama.cpp Llama()" in walls:
        floor = statistics.median(walls["llama.cpp Llama()"])
        for name in ("kvserve LLM()", "kvserve serve -> /health"):
            print(f"  {name} / llama.cpp: {statistics.median(walls[name]) / floor:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
