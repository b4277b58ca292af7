"""The Triton kernels compile for an H200 (sm_90) through the real compiler, down to cubin.

The interpreter tests check what the kernels compute; this checks that the GPU compiler accepts
them (it is stricter about types and layouts), with no GPU needed: Triton ships ptxas."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not importorskip: importing triton here, before the interpreter tests set TRITON_INTERPRET,
# would build triton.language without the interpreter for the whole session.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_aot.py"))],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # per dtype (bf16, fp32) 8 kernels, the block copy, and decode + extend for each quantized
    # format (int8, fp8, fp8_e5m2)
    assert proc.stdout.count("ok ") == 17 + 3 * 2, proc.stdout
