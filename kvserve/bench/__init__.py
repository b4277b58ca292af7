"""`kvserve bench latency | throughput | serve | prefix | kernels`: the benchmarks users compare
engines with, under vLLM's flag names (`vllm bench ...`), and the CPU kernels' micro-benchmarks.

- serve.py: an HTTP load generator against any OpenAI-compatible server (TTFT, TPOT, ITL, E2E
  percentiles), over datasets.py's workloads, through client.py's streaming client;
- latency.py, throughput.py: the offline `LLM` (the engine flags of `kvserve generate`);
- prefix.py: TTFT of a cold prompt against the same prompt with its prefix cached;
- kernels.py, kernel_cases.py: the kernels (GEMV, quantized GEMM, paged attention, the model
  forward, the engine step), each path checked against a reference before it is timed;
- soak.py: a long-running server's RSS under rounds of concurrent streams, some aborted;
- stats.py: percentiles and summaries; results.py: the JSON file and the plot.
"""
