"""The model's building blocks, and how their kernels are chosen and bound.

Kernel-free (what the model code imports): `linear` (projections as `LinearMethod` objects:
`apply(x)`, `apply_add(x, residual)`; `Dense`), `norm` (RMSNorm), `rotary` (RoPE tables and
rotation), `activation` (the gated MLP's act(gate) * up), `block` (a decoder layer's methods
for one row bucket, `LayerMethods`, and the dense ones it starts with), `buckets` (the row
buckets a kernel choice is made for).

Kernel choice (the model code never imports these; tests/test_architecture.py): `cpu_linear`
(the CPU's linear methods: oneDNN, the panel GEMM, the GEMV), `cpu_layer_ops` (a layer's
projections on each kernel), `gemm_select` (measures and decides the GEMM plan),
`selection` (binds the plan's methods onto a model, or the GPU's Triton ops), `fast_decode`
(the one-call C++ decode step the plan may install)."""
