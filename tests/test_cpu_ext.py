"""kvserve/model/cpu_ext.py: what a C++ kernel's build key covers, and that an installed package
carries every file its kernels compile (a `pip install .` that left out a header lost the paged
decode kernel without an error: the engine fell back to PyTorch attention)."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

from kvserve.model import cpu_ext, gemv, panel_gemm
from kvserve.model.attention import cpu_paged

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
