"""Resident memory of GGUF weights against the file's tensor bytes (issue 48, item 2).

For each file, a fresh process imports kvserve, builds the kernels, and loads the model as the
engine does (`load_model`, then `limit_positions` at --max-model-len); resident weights are
the VmRSS the load gained (/proc/self/status, after gc), the peak the process's VmHWM. Why a
process per file: RSS once grown stays, so one process would measure the first file only.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_gguf_memory.py FILE.gguf [FILE.gguf ...]

With --llama-server PATH it also times start-up against llama.cpp's: seconds from launching
`kvserve serve FILE` and `llama-server -m FILE` (same threads, same context) until /health
answers 200, the file in the page cache (read once first), engines alternating, --repeats
each, medians. That is what a user waits for; it includes each server's own set-up (Python's
imports and the KV pool for kvserve, the context and a warm-up decode for llama-server).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve.bench.record import Row, add_record_arg, ratio, write_record


def status_mb() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MB (10^6 bytes)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024 / 1e6
    return out


def worker(path: str, max_model_len: int) -> dict:
    """One file's figures, measured in this (fresh) process."""
    import torch

    torch.set_num_threads(2)
    from kvserve.kernels.cpu import qgemv
    from kvserve.model_loader.gguf_checkpoint import open_gguf
    from kvserve.model_loader.weight_bytes import weight_bytes
    from kvserve.worker.model_build import load_model

    qgemv.load()  # the extension's own pages are not weights
    tensor_bytes = sum(t.nbytes for t in open_gguf(path).index.tensors.values())
    gc.collect()
    before = status_mb()
    t0 = time.perf_counter()
    model, _ = load_model(path)
    model.limit_positions(max_model_len)
    load_s = time.perf_counter() - t0
    gc.collect()
    after = status_mb()
    resident = after["VmRSS"] - before["VmRSS"]
    return {"file": path, "tensor_mb": tensor_bytes / 1e6, "resident_mb": resident,
            "ratio": resident * 1e6 / tensor_bytes, "peak_mb": after["VmHWM"],
            "baseline_mb": before["VmRSS"], "load_s": load_s,
            "line": weight_bytes(model).line()}


def time_to_ready(cmd: list[str], port: int) -> float:
    """Seconds from launching a server to its first /health 200 (then it is stopped)."""
    from kvserve.bench.spawn import server

    t0 = time.perf_counter()
    with server(cmd, port, timeout=600):
        return time.perf_counter() - t0


def startup(path: str, llama_server: str, max_model_len: int, repeats: int) -> dict:
    from kvserve.bench.spawn import kvserve_command
    from kvserve.utils.ports import free_port

    Path(path).read_bytes()  # into the page cache
    times: dict[str, list[float]] = {"kvserve": [], "llama-server": []}
    for _ in range(repeats):
        port = free_port()
        times["kvserve"].append(time_to_ready(kvserve_command(
            port, path, ["--max-model-len", str(max_model_len)]), port))
        port = free_port()
        times["llama-server"].append(time_to_ready(
            [llama_server, "-m", path, "-t", "2", "-c", str(max_model_len), "--host",
             "127.0.0.1", "--port", str(port)], port))
    return {k: statistics.median(v) for k, v in times.items()} | {"runs": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--llama-server", default=None, help="also time start-up against it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_record_arg(ap, "startup-memory")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.files[0], args.max_model_len)))
        return
    from kvserve.kernels.cpu.cpu_features import cpu_info

    print(cpu_info().flags_line(), flush=True)
    loaded, started = [], []
    for path in args.files:
        proc = subprocess.run([sys.executable, __file__, "--worker", path, "--max-model-len",
                               str(args.max_model_len)], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            print(f"{path}: failed\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(lines[-1])
        print(f"{r['file']}: tensors {r['tensor_mb']:,.1f} MB, resident {r['resident_mb']:,.1f} "
              f"MB ({r['ratio']:.3f}x), peak {r['peak_mb']:,.0f} MB (baseline "
              f"{r['baseline_mb']:,.0f}), load {r['load_s']:.1f} s; {r['line']}", flush=True)
        loaded.append(r)
        if args.llama_server:
            t = startup(path, args.llama_server, args.max_model_len, args.repeats)
            print(f"  start-up to /health (median of {args.repeats}): kvserve "
                  f"{t['kvserve']:.1f} s, llama-server {t['llama-server']:.1f} s "
                  f"({t['kvserve'] / t['llama-server']:.2f}x); runs {t['runs']}", flush=True)
            started.append((path, t))
    if args.record:
        record(args, loaded, started)


def _label(path: str) -> str:
    """`llama-3.2-1b Q4_K_M` for ~/.cache/kvserve/gguf-models/llama-3.2-1b/Q4_K_M.gguf."""
    p = Path(path)
    return f"{p.parent.name} {p.stem}"


def record(args, loaded: list[dict], started: list[tuple[str, dict]]) -> None:
    """The figures page's records: resident weights over the file's tensor bytes (the issue's
    <= 1.1x), and with --llama-server the start-up beside llama-server's."""
    target = Path(args.record)
    json_path = target.suffix == ".json"
    if loaded:
        write_record(target if json_path else args.record, name="gguf-memory",
                     title="Resident weights per GGUF format against the file's tensor bytes",
                     peer="none: the file's tensor bytes (the issue's rule: resident weights "
                     "<= 1.1x)", notes="Resident = the VmRSS the load gained; peak = VmHWM.",
                     rows=[Row(f"{_label(r['file'])} resident weights", "MB",
                               round(r["resident_mb"], 1), round(r["tensor_mb"], 1),
                               round(r["ratio"], 3), "<= 1.1x", r["ratio"] <= 1.1)
                           for r in loaded])
    if started:
        write_record(target.with_name(target.stem + "-startup.json") if json_path
                     else args.record, name="gguf-startup",
                     title="Start-up to a ready server beside llama-server's",
                     peer=f"llama-server ({args.llama_server}) -t 2 -c {args.max_model_len}",
                     notes=f"Seconds from launch to the first /health 200, medians of "
                     f"{args.repeats}, engines alternating, the file in the page cache.",
                     rows=[Row(f"{_label(p)}: launch to the first /health 200", "s",
                               round(t["kvserve"], 2), round(t["llama-server"], 2),
                               ratio(t["kvserve"], t["llama-server"])) for p, t in started])


if __name__ == "__main__":
    main()
