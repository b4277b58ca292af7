"""CPU kernels: C++ sources (`csrc/`) compiled at first use (`cpu_ext`), the CPU's identity and
features (`cpu_features`), and the ctypes front ends of the GEMV (`gemv`) and the panel GEMM
(`panel_gemm`); the paged decode attention's front end is `kvserve.attention.cpu_paged`."""

from pathlib import Path

CSRC = Path(__file__).with_name("csrc")  # the C++ sources (and their headers)
