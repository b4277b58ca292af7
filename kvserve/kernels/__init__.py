"""The compute kernels below the layers: the CPU's C++ sources and their build and ctypes
loaders (`kernels.cpu`), and the GPU's fused element-wise Triton kernels (`kernels.gpu`). The
model code never imports this package: the layers get methods that run them from the
`ExecutionPlan` they are built with (`kvserve.layers.cpu_methods`; tests/test_architecture.py
checks it)."""
