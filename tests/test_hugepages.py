"""kvserve/utils/hugepages.py: the weights and the KV pool on 2 MiB pages, read back from the kernel's
own accounting (/proc/self/smaps), not from anything hugepages.py says of itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvserve.utils import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or absent here")


def huge_bytes_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping t's memory, in bytes."""
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


def test_empty_reads_as_zeros_and_holds_what_is_written():
    t = hugepages.empty((3, 1 << 18), torch.float32)  # 3 MiB: not a whole number of huge pages
    assert t.shape == (3, 1 << 18) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert not t.any()
    t[-1, -1] = 7.0
    t[0].fill_(1.0)
    assert t[-1, -1] == 7.0 and bool((t[0] == 1).all()) and not t[1].any()
    small = hugepages.empty((4, 4), torch.bfloat16)  # under MIN_BYTES: torch's own memory
    assert small.dtype == torch.bfloat16 and not small.any()
    assert hugepages.empty((0, 8), torch.float32).numel() == 0


def mapping_rss(t: torch.Tensor) -> int:
    """Rss of the mapping that holds t's first byte, in bytes."""
    begin, inside = t.untyped_storage().data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= begin < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


BIG = (hugepages.CHUNK // 2 + HUGE,)  # bytes (uint8): past the arena, a mapping of its own


@needs_thp
def test_empty_memory_is_faulted_in_as_huge_pages_only_where_written():
    t = hugepages.empty(BIG, torch.uint8)
    assert huge_bytes_under(t) == 0  # nothing resident before it is written
    t[: 4 << 20].fill_(1)
    assert 4 << 20 <= huge_bytes_under(t) <= 6 << 20


@needs_thp
def test_small_tensors_share_huge_pages():
    """Eight 1.5 MiB tensors cut from one arena mapping: ~12 MiB resident once written, not
    eight 2 MiB-rounded pages each (16 MiB), and on huge pages; no two overlap."""
    arena = hugepages._Arena()
    parts = []
    for _ in range(8):
        memory, offset = arena.take(3 << 19)
        parts.append(torch.frombuffer(memory, dtype=torch.uint8, count=3 << 19, offset=offset))
    starts = [p.data_ptr() for p in parts]
    assert all(b - a == 3 << 19 for a, b in zip(starts, starts[1:]))  # one after another
    for i, p in enumerate(parts):
        assert not p.any()
        p.fill_(i + 1)
    assert all(bool((p == i + 1).all()) for i, p in enumerate(parts))
    assert mapping_rss(parts[0]) <= 14 << 20
    assert huge_bytes_under(parts[0]) >= 10 << 20


def test_off_switch_keeps_the_memory_usable(monkeypatch):
    hugepages._madvise.cache_clear()
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    try:
        assert hugepages._madvise() is None
        t = hugepages.empty(BIG, torch.uint8)
        t.fill_(3)
        assert bool((t == 3).all())
        if THP.exists() and "[madvise]" in THP.read_text():  # ("always" gives them anyway)
            assert huge_bytes_under(t) == 0
    finally:
        monkeypatch.undo()
        hugepages._madvise.cache_clear()


@needs_thp
def test_engine_weights_and_kv_pool_sit_on_huge_pages(tiny_model_dir):
    from kvserve.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                    kv_cache_memory_bytes=1 << 30, block_size=16))
    pool = engine.tensors.layers[0][0]
    assert pool.untyped_storage().nbytes() > hugepages.CHUNK // 2  # a mapping of its own
    # the pool's pages are faulted in as blocks are written: on 2 MiB pages, and zero where
    # nothing was written
    assert huge_bytes_under(pool) == 0
    pool[: pool.shape[0] // 2].fill_(1.0)
    assert huge_bytes_under(pool) >= 2 << 20
    assert not pool[pool.shape[0] // 2:].any()
    big = [w for w in engine.model.parameters() if w.untyped_storage().nbytes() >= 4 << 20]
    assert all(huge_bytes_under(w) >= 2 << 20 for w in big)
