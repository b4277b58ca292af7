"""GPU kernels: fused element-wise Triton kernels (`ops`: RMSNorm, RoPE, SiLU-and-mul). The
attention's Triton kernels sit with their backends in `kvserve.attention`."""
