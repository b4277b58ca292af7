"""What this CPU is and which instructions it has that matter for inference speed.

Why: the right GEMM kernel, whether bf16 is a speed-up or a trap, and how a benchmark figure is
to be read all depend on the CPU. x86 machines of the same kind differ (AVX2-only EPYCs,
AVX-512 Xeons, Zen 5 with bf16): a bf16 matmul on a CPU without bf16 instructions runs in
software, orders of magnitude slower. No torch import: the CLI and benchmarks' drivers use it.

`KVSERVE_CPU_ISA=avx2` caps what kvserve uses to an AVX2-only x86 (x86-64-v3): its C++
kernels are built for it and the CPU's flags above it are dropped (no AVX-512, AMX, AVX-VNNI).
`KVSERVE_CPU_ISA=avx512` caps it to an Ice Lake Xeon (AVX-512 with VNNI; no bf16, fp16 or AMX).
Why: to measure and test, on one of this project's machines, what a user of an AVX2-only CPU
(the EPYCs of issue 18) or of an Ice Lake (issue 64) gets. The libraries under torch have caps of their own, which a benchmark
sets with it (`isa_cap_env`).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that change which kernels are fast (Linux /proc/cpuinfo names).
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

ISA_ENV = "KVSERVE_CPU_ISA"
# cap -> (the -march its kernels are built for, the flags that level needs (Linux names), the
# flag prefixes above it)
ISA_CAPS = {"avx2": ("x86-64-v3", ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"),
                     ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")),
            # AVX-512 with VNNI and without bf16, fp16 or AMX: an Ice Lake Xeon (issue 64's
            # third kind), whose GEMM plan and kernels differ from a Sapphire Rapids' or a
            # Zen 4's
            "avx512": ("icelake-server",
                       ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq",
                        "avx512vl", "avx512_vnni"),
                       ("avx512_bf16", "avx512_fp16", "amx", "avx_vnni", "avx_ifma",
                        "avx_ne_convert"))}


def isa_cap() -> str | None:
    """The instruction-set cap $KVSERVE_CPU_ISA names (None: native, all the CPU has). A cap
    is a maximum the CPU must reach: on a CPU without it the kernels built for it would stop
    on an illegal instruction, so that is an error here."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected native or one of {sorted(ISA_CAPS)}")
    missing = [f for f in ISA_CAPS[value][1] if f not in _host_cpu().flags]
    if missing:
        raise ValueError(f"{ISA_ENV}={value}: this CPU lacks {', '.join(missing)}, which "
                         f"{ISA_CAPS[value][0]} needs; the cap can only lower what a CPU has")
    return value


def march() -> str:
    """The -march kvserve's C++ kernels are built for: native, or the cap's."""
    cap = isa_cap()
    return ISA_CAPS[cap][0] if cap else "native"


# The libraries under torch that take a cap of their own: variable -> how it spells one.
# DNNL_MAX_CPU_ISA is oneDNN's older name, which it still reads: set in a shell it changes
# oneDNN's speed as much as the new one, so the GEMM choice's cache key has to see it too.
LIBRARY_ISA_ENV = {"ATEN_CPU_CAPABILITY": {"avx2": "avx2", "avx512": "avx512"},
                   "MKL_ENABLE_INSTRUCTIONS": {"avx2": "AVX2", "avx512": "AVX512"},
                   "ONEDNN_MAX_CPU_ISA": {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI"},
                   "DNNL_MAX_CPU_ISA": {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI"}}


def isa_cap_env(cap: str) -> dict[str, str]:
    """The environment that caps kvserve and the libraries under torch (ATen's vector code,
    MKL, oneDNN) to `cap`, for a process started with it: what a benchmark runs its workers
    (kvserve's and the peers') under to emulate an older CPU."""
    if cap not in ISA_CAPS:
        raise ValueError(f"unknown instruction-set cap {cap!r}: one of {sorted(ISA_CAPS)}")
    return {ISA_ENV: cap, **{var: spelled[cap] for var, spelled in LIBRARY_ISA_ENV.items()}}


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    logical_cpus: int
    isa_cap: str | None = None  # the flags above this cap were dropped (see ISA_ENV)

    @property
    def has_bf16(self) -> bool:
        """Native bf16 arithmetic (AVX512_BF16 or AMX-BF16): where bf16 runs faster than fp32
        rather than in emulation."""
        return any(f in self.flags for f in BF16_FLAGS)

    def summary(self) -> str:
        """One line for logs and benchmark headers, e.g. 'Intel(R) Xeon(R) ... | AVX2 yes,
        AVX-512 yes, AVX512_BF16 yes, AMX no'."""
        def yes(*names: str) -> str:
            return "yes" if any(n in self.flags for n in names) else "no"

        return (f"{self.model_name} ({self.logical_cpus} logical CPUs) | AVX2 {yes('avx2')}, "
                f"AVX-512 {yes('avx512f')}, AVX512_BF16 {yes('avx512_bf16')}, "
                f"AMX {yes('amx_bf16', 'amx_tile')}"
                + (f" (capped to {self.isa_cap.upper()} by {ISA_ENV})" if self.isa_cap else ""))

    def flags_line(self) -> str:
        """The summary and the SIMD flags, as a benchmark prints them beside its figures."""
        simd = sorted(f for f in self.flags if f.startswith(("avx", "fma", "f16c", "amx")))
        return f"{self.summary()}; flags: {' '.join(simd)}"


def parse_cpuinfo(text: str) -> CpuInfo:
    """CpuInfo from the text of /proc/cpuinfo (the first processor's model name and flags)."""
    model, flags, cpus = "", frozenset(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpus += 1
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model or platform.processor() or platform.machine(), flags, max(cpus, 1))


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (empty flags off Linux, where /proc/cpuinfo is missing), less the
    flags above $KVSERVE_CPU_ISA's cap."""
    info = _host_cpu()
    cap = isa_cap()
    if cap is None:
        return info
    above = ISA_CAPS[cap][2]
    return CpuInfo(info.model_name, frozenset(f for f in info.flags if not f.startswith(above)),
                   info.logical_cpus, cap)


@functools.lru_cache(maxsize=1)
def _host_cpu() -> CpuInfo:
    """What /proc/cpuinfo says, uncapped."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), frozenset(), 1)


@functools.lru_cache(maxsize=1)
def l3_cache_bytes() -> int | None:
    """The last-level (L3) cache of CPU 0, from sysfs; None where it is not reported."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            return None
    return None
