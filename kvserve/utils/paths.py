"""Where kvserve keeps what it makes locally: the default model, built C++ kernels, measured
GEMM choices. One root, `$KVSERVE_CACHE_DIR` (default ~/.cache/kvserve), read here only; no
torch import, so drivers that never load a model can ask too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"
