"""The model's building blocks and how their kernels are chosen: `gemm_select` measures and
decides the GEMM plan (which kernel per projection and row bucket), `fast_decode` is the one-call
C++ decode step the plan may install."""
