"""The reference model the peer comparisons measure on (/work/shared/ANCHORS.md): Qwen2
architecture, hidden 512, 8 layers, random weights, made once by `make_model(arch="qwen2",
size="small", seed=0)` under the cache directory as bench-qwen2-small. It is rebuilt when
make_model's config or weight generator changes (a stamp of both is kept beside it), so a
figure is never measured on a stale checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvserve.utils.paths import cache_dir

NAME = "bench-qwen2-small"
_STAMP_FILE = ".bench-stamp.json"
_STAMP_CODE = """
import hashlib, inspect, json
from kvserve.model_loader import make_model as m
config = m.hf_config("qwen2", "small", "float32")
code = inspect.getsource(m.random_weights).encode()
print(json.dumps({"config": config, "random_weights": hashlib.sha256(code).hexdigest()},
                 sort_keys=True))
"""
_MAKE_CODE = ("import sys; from kvserve.model_loader.make_model import make_model; "
              "make_model(sys.argv[1], arch='qwen2', size='small', seed=0, dtype='float32')")


def checkpoint_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _python(code: str, *argv: str, timeout: float) -> str:
    """Run `code` in a fresh interpreter (make_model's torch state stays out of this one)."""
    out = subprocess.run([sys.executable, "-c", code, *argv], check=True, timeout=timeout,
                         capture_output=True, text=True)
    return out.stdout.strip()


def ensure_checkpoint(path: Path | None = None, timeout: float = 900) -> Path:
    """The reference checkpoint at `path` (default: the cache's), made or remade as needed;
    written to a temporary directory and renamed, so a concurrent run never sees half of it."""
    path = Path(path or cache_dir() / NAME)
    stamp = _python(_STAMP_CODE, timeout=timeout).splitlines()[-1]
    stamp_file = path / _STAMP_FILE
    if checkpoint_ready(path) and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    why = "stale (make_model changed)" if checkpoint_ready(path) else "missing"
    print(f"reference checkpoint {why}: creating it in {path}", file=sys.stderr)
    _python(_MAKE_CODE, str(tmp), timeout=timeout)
    if not checkpoint_ready(tmp):
        raise RuntimeError(f"make_model wrote no checkpoint into {tmp}")
    (tmp / _STAMP_FILE).write_text(stamp)
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        path.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not checkpoint_ready(path):
            raise
    return path
