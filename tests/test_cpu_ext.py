"""kvserve/kernels/cpu/cpu_ext.py: what a C++ kernel's build key covers, and that an installed package
carries every file its kernels compile (a `pip install .` that left out a header lost the paged
decode kernel without an error: the engine fell back to PyTorch attention); the instruction-set
cap (KVSERVE_CPU_ISA, cpu_features) that emulates an AVX2-only CPU, end to end."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from kvserve.kernels.cpu import cpu_ext, cpu_features, gemv, panel_gemm
from kvserve.attention import cpu_paged

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvserve"
SOURCES = [cpu_paged.SOURCE, gemv.SOURCE, panel_gemm.SOURCE]


def test_every_compiled_file_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["kvserve"]
    for source in SOURCES:
        for path in [source, *cpu_ext.local_includes(source)]:
            rel = path.resolve().relative_to(PACKAGE).as_posix()
            assert any(fnmatch(rel, g) for g in globs), f"{rel} is not in package-data"


def test_a_local_include_changes_the_build_key(tmp_path):
    header = tmp_path / "inc" / "h.h"
    header.parent.mkdir()
    header.write_text("#define X 1\n")
    source = tmp_path / "k.cpp"
    source.write_text('#include <cstdint>\n#include "inc/h.h"\n#include "omp.h"\nint f();\n')
    assert cpu_ext.local_includes(source) == [header.resolve()]  # "omp.h": not a local file
    cxx = cpu_ext.compiler() or "c++"
    before = cpu_ext.build_key(source, cpu_ext.CXXFLAGS, cxx)
    header.write_text("#define X 2\n")
    assert cpu_ext.build_key(source, cpu_ext.CXXFLAGS, cxx) != before


def test_isa_cap_names(monkeypatch):
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert cpu_features.isa_cap() == "avx2" and cpu_features.march() == "x86-64-v3"
    env = cpu_features.isa_cap_env("avx2")
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    # an Ice Lake: AVX-512 with VNNI, its libraries capped there too (oneDNN's own name)
    env = cpu_features.isa_cap_env("avx512")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI" and env["ATEN_CPU_CAPABILITY"] == "avx512"
    no_bf16 = cpu_features.CpuInfo("a Sapphire Rapids", frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
         "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"}), 2)
    monkeypatch.setattr(cpu_features, "_host_cpu", lambda: no_bf16)
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx512")
    cpu_features.cpu_info.cache_clear()
    try:
        assert cpu_features.march() == "icelake-server"
        capped = cpu_features.cpu_info()
        assert "avx512_vnni" in capped.flags and not capped.has_bf16
        assert not {"amx_tile", "avx_vnni"} & capped.flags
    finally:
        cpu_features.cpu_info.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    assert cpu_features.isa_cap() is None and cpu_features.march() == "native"
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA"):
        cpu_features.isa_cap()
    with pytest.raises(ValueError, match="instruction-set cap"):
        cpu_features.isa_cap_env("sse9")
    # a cap only lowers what a CPU has: kernels built above it would stop on SIGILL
    old_cpu = cpu_features.CpuInfo("an old x86", frozenset({"sse2", "avx"}), 2)
    monkeypatch.setattr(cpu_features, "_host_cpu", lambda: old_cpu)
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="lacks avx2, bmi1"):
        cpu_features.isa_cap()


CAPPED = """
import json, sys
import torch
from helpers import hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kernels.cpu import cpu_ext, cpu_features, gemv, panel_gemm
from kvserve.layers import gemm_select
from kvserve.attention import cpu_paged
path = sys.argv[1]
prompts = random_prompts([5, 40, 77, 9, 130, 3, 64, 21], 512, seed=3)  # decodes of 8 rows
llm = LLM(model=path, dtype="float32", max_model_len=256, block_size=16)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
key = gemm_select.cache_key("float32", torch.get_num_threads(), {"q": (8, 8)}, "x")
plan = llm.engine.runner.model.gemm_plan.kernels
print(json.dumps({"flags": sorted(cpu_features.cpu_info().flags), "cxxflags": cpu_ext.CXXFLAGS,
                  "aten": torch.backends.cpu.get_cpu_capability(), "key": key,
                  "kernels": [panel_gemm.load() is not None, gemv.load() is not None,
                              cpu_paged.load_kernel() is not None],
                  "panel_rows_8": plan["qkv"][1],
                  "got": [o.outputs[0].token_ids for o in outs],
                  "want": hf_greedy(path, prompts, 12)}))
"""


def _has_x86_64_v3() -> bool:
    from kvserve.kernels.cpu.cpu_features import ISA_CAPS, _host_cpu

    return all(f in _host_cpu().flags for f in ISA_CAPS["avx2"][1])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_x86_64_v3()
                    or panel_gemm.load() is None, reason="the AVX2 cap needs an x86-64-v3 CPU "
                    "and a compiler")
def test_capped_to_avx2_end_to_end(hf_checkpoints):
    """A fresh process under KVSERVE_CPU_ISA=avx2 and the libraries' caps
    (cpu_features.isa_cap_env), every projection on the panel GEMM where it is offered
    (KVSERVE_KERNEL=panel): kvserve's kernels are built for x86-64-v3 and load, no flag above
    AVX2 is left in what it reads, ATen runs its AVX2 code, the GEMM choice is cached under a
    key of its own, and greedy tokens through the AVX2 tiles (decodes of 8 rows) equal
    transformers' (run under the same caps)."""
    env = dict(os.environ, **cpu_features.isa_cap_env("avx2"), KVSERVE_KERNEL="panel",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", CAPPED, str(hf_checkpoints["qwen2"])],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "-march=x86-64-v3" in out["cxxflags"]
    assert out["kernels"] == [True, True, True], "a kernel did not build under the cap"
    assert out["panel_rows_8"] == "panel"
    assert not [f for f in out["flags"] if f.startswith(("avx512", "amx"))]
    assert out["aten"] == "AVX2"
    assert "|isa ATEN_CPU_CAPABILITY=avx2," in out["key"]
    assert out["got"] == out["want"]
