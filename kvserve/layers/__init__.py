"""The model's building blocks, and how a model's methods are chosen before it is built.

Kernel-free (what the model code imports): `plan` (the `ExecutionPlan` every constructor is
handed, and `MethodSource`, the dense methods of a platform), `methods` (a layer's
`DecoderMethod`, the head's `HeadMethod`, `Embedding`, `Projection`, tensor parallelism's
variants), `linear` (projections as `LinearMethod` objects: `apply(x)`,
`apply_add(x, residual)`; `Dense`), `norm` (RMSNorm), `rotary` (RoPE tables and rotation),
`activation` (the gated MLP's act(gate) * up), `block` (a decoder layer's methods for one row
bucket, `LayerMethods`, and the dense ones), `buckets` (the row buckets a kernel choice is
made for).

The kernels' side (the model code never imports these; tests/test_architecture.py):
`selection` (`plan_for`: the plan a load asks for, the GEMM plan's measurement, dtype
resolution, oneDNN warm-up), `cpu_methods` (the CPU's methods: the measured GEMM plan,
quantized weights, the one-call decode steps), `cpu_linear` and `cpu_layer_ops` (the CPU
kernels as methods and layer ops), `gemm_select` (measures and decides the GEMM plan),
`quant_linear`, `quant_decode`, `quantize_at_load` (GGUF blocks), `kernel_choice` (a
quantized weight's one kernel choice, at load; $KVSERVE_KERNEL), `plan_cache` (the measured
choices' JSON cache),
`fast_decode` (the one-call float decode step)."""
