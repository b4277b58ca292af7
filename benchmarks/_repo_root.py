"""Puts the repository root on sys.path, for the scripts here that import the bench lab
(benchmarks/lab/). Run as `python benchmarks/bench_x.py`, a script sees benchmarks/ on its path,
not the root, and the lab is not installed with kvserve (it serves these scripts and
docs/figures/, not `kvserve bench`); under `python -m` and pytest the root is there already."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
