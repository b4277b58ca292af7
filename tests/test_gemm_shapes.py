"""The oneDNN GEMMs run with a bounded set of row counts (issue 11, defect 6: server RSS grew by
12-15 MB per round of 256 concurrent requests).

oneDNN JIT-compiles and caches a primitive per distinct GEMM shape; with every step's token
count used as is, a server under varied load kept compiling and caching new primitives, and its
RSS grew for as long as both oneDNN caches (1,024 entries each) had room. The decoder now rounds
the rows up (`gemm_rows`), so a workload with many different prompt lengths compiles only the
rounded shapes. The count is read from oneDNN's own log of primitive creations (a subprocess
with ONEDNN_VERBOSE=profile_create)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.layers.cpu_linear import gemm_rows, onednn_available
from kvserve.layers.cpu_linear import onednn_linear as _onednn_linear
from kvserve.layers.cpu_linear import onednn_linear_add as _onednn_linear_add
from kvserve.layers.cpu_linear import onednn_pack as _onednn_pack
from kvserve.layers.selection import warm_up_gemms

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32, torch.device("cpu")),
                                reason="oneDNN-packed GEMMs are not used on this machine")

ROOT = Path(__file__).resolve().parents[1]

_WORKLOAD = """
from kvserve import LLM, SamplingParams
llm = LLM(max_model_len=256, num_threads=1, enable_prefix_caching=False, quantization="none")
for n in range(17, 81):  # one prefill per prompt length: 64 different token counts
    llm.generate([{"prompt_token_ids": list(range(10, 10 + n))}], SamplingParams(max_tokens=1))
"""


def test_gemm_rows_are_few_and_pad_little():
    sizes = {gemm_rows(t) for t in range(1, 8193)}
    # 128 row counts x 5 GEMMs + the LM head's (<= max_num_seqs rows): under 1,024 primitives
    assert len(sizes) <= 128
    assert all(t <= gemm_rows(t) <= t * 1.125 for t in range(1, 257))
    assert all(t <= gemm_rows(t) <= t * 1.0625 for t in range(257, 8193))  # prefill sizes
    assert [gemm_rows(t) for t in (1, 16, 17, 64, 65, 257, 2112, 8192)] == \
        [1, 16, 18, 64, 72, 272, 2176, 8192]


@pytest.mark.parametrize("t", [1, 17, 100, 513])
def test_padded_gemms_give_the_unpadded_result(t):
    torch.manual_seed(t)
    w = torch.randn(96, 64)
    packed = _onednn_pack(w)
    x, residual = torch.randn(t, 64), torch.randn(t, 96)
    y = _onednn_linear(x, packed, None)
    assert y.shape == (t, 96) and y.is_contiguous()
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_onednn_linear_add(x, residual, packed, None), residual + x @ w.t(),
                               rtol=1e-5, atol=1e-5)


def test_varied_prompt_lengths_compile_only_rounded_gemm_shapes(tmp_path):
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), KVSERVE_KERNEL="onednn")  # every GEMM through oneDNN
    env.setdefault("KVSERVE_CACHE_DIR", str(ROOT / ".kvserve-cache"))
    out = subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {int(m.group(1)) for line in out.stdout.splitlines()
            if "create:cache_miss" in line and ",inner_product," in line
            for m in [re.search(r",mb(\d+)ic", line)] if m}
    assert rows, out.stdout[-2000:]
    prefill_rows = {r for r in rows if r > 16}
    # 64 prompt lengths (17..80) make 20 rounded sizes; unrounded they made 64.
    assert prefill_rows <= {gemm_rows(t) for t in range(17, 81)}, sorted(prefill_rows)
    assert len(prefill_rows) <= 20, sorted(prefill_rows)


_WARMED_WORKLOAD = """
import ctypes, os
from kvserve import LLM, SamplingParams
llm = LLM(max_model_len=256, num_threads=1, enable_prefix_caching=False, max_num_seqs=8,
          quantization="none",
          max_num_batched_tokens=256)
model = llm.engine.model
from kvserve.layers.selection import warm_up_gemms
print("WARMED", warm_up_gemms(model, 256, 8), flush=True)
ctypes.CDLL(None).fflush(None)  # oneDNN logs through C stdio: keep the order
os.write(1, b"SERVING\\n")
prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in range(17, 81)]
llm.generate(prompts[:5], SamplingParams(max_tokens=3))
for p in prompts:
    llm.generate([p], SamplingParams(max_tokens=2))
ctypes.CDLL(None).fflush(None)
"""


def test_after_the_warm_up_serving_compiles_no_gemm(tmp_path):
    """`kvserve serve` warms every GEMM shape up front (`selection.warm_up_gemms`): afterwards a
    workload with 64 prompt lengths and mixed batches finds every GEMM compiled already."""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), KVSERVE_KERNEL="onednn")  # every GEMM through oneDNN
    env.setdefault("KVSERVE_CACHE_DIR", str(ROOT / ".kvserve-cache"))
    out = subprocess.run([sys.executable, "-c", _WARMED_WORKLOAD], env=env, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    before, _, after = out.stdout.partition("SERVING\n")
    warmed = int(re.search(r"WARMED (\d+)", before).group(1))
    assert warmed == len({gemm_rows(t) for t in range(1, 257)})
    assert "inner_product" in before and "inner_product" in after  # the log works
    misses = [line for line in after.splitlines()
              if "create:cache_miss" in line and ",inner_product," in line]
    assert not misses, misses[:5]


def test_warm_up_stays_within_its_flop_budget():
    from kvserve.worker.model_build import load_model
    from kvserve.model_loader.make_model import ensure_default_model

    model = load_model(ensure_default_model(), gemm="onednn")[0]
    assert warm_up_gemms(model, 8192, 256, max_flops=0) == 0
    some = warm_up_gemms(model, 8192, 256, max_flops=5e7)
    assert 0 < some < len({gemm_rows(t) for t in range(1, 8193)})


def test_dense_gemms_compile_no_onednn_kernels(tmp_path):
    """The dense kernel in float32 (F.linear: MKL), which the measured GEMM choice may pick for
    some row buckets, goes through no per-shape oneDNN cache: 64 prompt lengths create no
    oneDNN GEMM primitive at all, so it needs no row rounding. (In bfloat16 F.linear is a
    oneDNN call per shape, which is why the choice is made in float32 only.)"""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), KVSERVE_KERNEL="dense")
    env.setdefault("KVSERVE_CACHE_DIR", str(ROOT / ".kvserve-cache"))
    workload = _WORKLOAD.replace("LLM(", "LLM(dtype='float32', ")
    out = subprocess.run([sys.executable, "-c", workload], env=env, check=False,
                         capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    gemms = [line for line in out.stdout.splitlines() if "create:" in line
             and (",inner_product," in line or ",matmul," in line)
             and "ic8oc8" not in line]  # onednn_available's 8 x 8 probe
    assert not gemms, gemms[:3]
