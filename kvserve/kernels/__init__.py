"""The compute kernels below the layers: the CPU's C++ sources and their build and ctypes
loaders (`kernels.cpu`), and the GPU's fused element-wise Triton kernels (`kernels.gpu`). The
model code never imports this package: `kvserve.layers.selection` binds kernels onto layers as
methods (tests/test_architecture.py checks it)."""
