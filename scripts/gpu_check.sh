#!/usr/bin/env bash
# The one prepared GPU run (issue: GPU backend): the GPU-only tests, then the H200 benchmark.
# Meant for the lent GPU machine, whose python3 already holds torch 2.11, Triton 3.6,
# transformers and the rest of kvserve's run-time needs (no .venv there): from the repo root,
#   bash scripts/gpu_check.sh OUTDIR        (about 8 minutes; logs and JSON land in OUTDIR)
# On a CPU-only machine the tests skip and the benchmark runs its --smoke shapes instead.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/kvserve-gpu}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
py="${PYTHON:-python3}"
smoke=""
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || smoke="--smoke"
"$py" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
    | tee -a "$out/versions.txt"
timeout 150 "$py" -m pytest -q -p no:cacheprovider -x tests/test_gpu.py \
    tests/test_triton_kernels.py 2>&1 | tee "$out/tests.log"
timeout 480 "$py" benchmarks/bench_gpu.py $smoke --out "$out/bench_gpu.json" 2>&1 \
    | tee "$out/bench.log"
