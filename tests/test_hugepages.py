"""kvserve/hugepages.py: the weights and the KV pool on 2 MiB pages, read back from the kernel's
own accounting (/proc/self/smaps), not from what `advise` returns."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch

from kvserve import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or absent here")


def huge_bytes_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping t's memory, in bytes (an madvise splits a
    mapping, so a tensor may span several)."""
    begin = t.untyped_storage().data_ptr()
    end = begin + t.untyped_storage().nbytes()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and begin < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


@needs_thp
def test_written_memory_is_collapsed():
    """A tensor written on 4 KiB pages (64 MiB: its own mapping from the kernel, past glibc's
    largest mmap threshold) is on huge pages after `advise`, data intact. (Measured as the huge
    pages of the mappings around it: at least its 2 MiB-aligned interior.)"""
    if tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux >= 6.1")
    t = torch.ones(16 << 20)
    begin = t.untyped_storage().data_ptr()
    interior = (begin + t.numel() * 4) // HUGE * HUGE - (begin + HUGE - 1) // HUGE * HUGE
    assert hugepages.advise([t]) >= interior
    assert huge_bytes_under(t) >= interior
    assert bool((t == 1).all())  # the data moved with its pages


def test_off_switch_and_tensors_it_cannot_see(monkeypatch):
    # oneDNN's packed weights are opaque (no pointer to read): left alone, no error
    if torch.backends.mkldnn.is_available():
        hugepages.advise([torch.randn(64, 64).to_mkldnn(), torch.empty(0)])
    hugepages._madvise.cache_clear()
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    try:
        assert hugepages.advise([torch.empty(8 << 20, dtype=torch.uint8)]) == 0
    finally:
        monkeypatch.undo()
        hugepages._madvise.cache_clear()


@needs_thp
def test_engine_weights_and_kv_pool_sit_on_huge_pages(tiny_model_dir):
    from kvserve.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                    kv_cache_memory_bytes=16 << 20, block_size=16))
    pool = engine.tensors.layers[0][0]
    assert pool.untyped_storage().nbytes() >= 4 << 20
    # the pool's pages are faulted in as blocks are written (kv/tensors.py's _zeros): on 2 MiB
    # pages, and zero where nothing was written
    assert huge_bytes_under(pool) == 0
    pool[: pool.shape[0] // 2].fill_(1.0)
    assert huge_bytes_under(pool) >= 2 << 20
    assert not pool[pool.shape[0] // 2:].any()
    # the weights were written before they were advised: only MADV_COLLAPSE (Linux >= 6.1)
    # re-backs them
    release = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    biggest = max(engine.model.parameters(), key=lambda w: w.numel())
    if biggest.untyped_storage().nbytes() >= 4 << 20 and release >= (6, 1):
        assert huge_bytes_under(biggest) >= 2 << 20


def test_tensors_without_plain_storage_are_skipped():
    """Sparse and oneDNN-opaque tensors have no memory range to advise: skipped, no error."""
    sparse = torch.eye(1024).to_sparse()
    assert hugepages.advise([sparse, torch.empty(0)]) == 0
