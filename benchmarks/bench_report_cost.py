#!/usr/bin/env python
"""What the cache report itself costs (issue 33, acceptance 6): bench_throughput's main
workload (64 x 128 -> 128, the reference model, float32) with `kv_cache_report` on every
request, timing every `build_report` call (the report's whole work, decided once at
admission) against the run's wall time. Three runs: the first cold, the next two with the
prompts cached (the report then walks a hit).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_report_cost.py
"""
import random, time, sys
sys.path.insert(0, "benchmarks")
import bench_throughput as bt
import kvserve.engine.scheduler as sch
from kvserve import LLM, SamplingParams
model = bt.ensure_checkpoint(bt.cache_dir() / "bench-qwen2-small", 600)
spent = [0.0, 0]
orig = sch.build_report
def timed(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
sch.build_report = timed
llm = LLM(model=str(model), dtype="float32", num_threads=2, max_num_seqs=64, max_model_len=256, block_size=16)
rng = random.Random(0)
prompts = [[rng.randrange(3, 32000) for _ in range(128)] for _ in range(64)]
p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, kv_cache_report=True)
llm.generate([{"prompt_token_ids": x} for x in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
for rep in range(3):
    spent[:] = [0.0, 0]
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False); wall = time.perf_counter() - t
    print(f"wall {wall:.3f} s, build_report {spent[1]} calls {spent[0]*1000:.2f} ms = {100*spent[0]/wall:.3f}% of the run")
