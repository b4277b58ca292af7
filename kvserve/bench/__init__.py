"""`kvserve bench latency | throughput | serve | prefix`: the benchmarks users compare engines
with, under vLLM's flag names (`vllm bench ...`).

- serve.py: an HTTP load generator against any OpenAI-compatible server (TTFT, TPOT, ITL, E2E
  percentiles), over datasets.py's workloads, through client.py's streaming client;
- latency.py, throughput.py: the offline `LLM` (the engine flags of `kvserve generate`);
- prefix.py: TTFT of a cold prompt against the same prompt with its prefix cached;
- stats.py: percentiles and summaries; results.py: the JSON file and the plot.
"""
