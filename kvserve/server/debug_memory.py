"""Opt-in memory diagnostics for a running server: `KVSERVE_DEBUG_MEMORY=1 kvserve serve ...`.

Why: a memory soak (`kvserve bench soak`) can tell that RSS grows, not what grows. With
this opt-in the server answers `GET /debug/memory` with:
the top allocation sites that grew since the previous call, the Python object counts by type
that grew, the sizes of the engine's per-request maps (which must be empty when idle), and
the RSS by kind of mapping (the brk heap, anonymous mappings, files). `POST /debug/memory/trim`
calls `malloc_trim(0)`, to tell allocator fragmentation (RSS that trimming gives back) from live
memory. With `KVSERVE_DEBUG_MEMORY=tracemalloc` it also starts `tracemalloc` (25 frames) and
reports the allocation sites that grew since the previous call; Python's own allocations are
then accounted for, so what RSS grows beyond them is native (torch, Rust, C extensions).

Nothing here is imported or routed unless the variable is set; tracemalloc slows the server
down noticeably, so it is for diagnosis only.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import tracemalloc
from typing import Any

ENV_VAR = "KVSERVE_DEBUG_MEMORY"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _rss_by_mapping() -> dict[str, int]:
    """Resident kB per kind of mapping, from /proc/self/smaps: [heap] is glibc's main arena."""
    out: dict[str, int] = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:
                name = first[5].strip() if len(first) > 5 else "[anon]"
                if name.startswith("/"):
                    name = "files"
            elif line.startswith("Rss:"):
                out[name] += int(line.split()[1])
    return dict(out)


def _type_counts() -> collections.Counter:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def engine_maps(engine: Any) -> dict[str, int]:
    """Sizes of the per-request state of the async engine, the engine, scheduler and KV
    manager (`AsyncLLMEngine.state_sizes`), and of the stat loggers: all of it should be
    empty when no request is running."""
    sizes = engine.state_sizes()
    for sl in engine.stat_loggers:
        reqs = getattr(sl, "_requests", None)
        if reqs is not None:
            sizes[f"{type(sl).__name__}._requests"] = len(reqs)
    return sizes


class MemoryProbe:
    """Keeps the previous snapshot so each call reports what grew since the last one."""

    def __init__(self, trace: bool) -> None:
        self.trace = trace
        if trace:
            tracemalloc.start(25)
            self._snapshot = tracemalloc.take_snapshot()
        self._types = _type_counts()

    def report(self, engine: Any, top: int = 15) -> dict[str, Any]:
        gc.collect()
        types = _type_counts()
        grown = (types - self._types).most_common(top)
        self._types = types
        report: dict[str, Any] = {
            "rss_kb": _rss_kb(), "rss_by_mapping_kb": _rss_by_mapping(),
            "gc_counts": gc.get_count(), "gc_garbage": len(gc.garbage),
            "engine_maps": engine_maps(engine), "types_grown": grown}
        if self.trace:
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            stats = snap.compare_to(self._snapshot, "traceback")
            self._snapshot = snap
            current, peak = tracemalloc.get_traced_memory()
            report.update(traced_kb=current // 1024, traced_peak_kb=peak // 1024, top_growth=[
                {"size_diff_kb": s.size_diff / 1024, "count_diff": s.count_diff,
                 "size_kb": s.size / 1024,
                 "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback][-8:]}
                for s in stats[:top] if s.size_diff > 0])
        return report


def malloc_trim() -> dict[str, int]:
    """Give free heap memory back to the OS (glibc); RSS before and after."""
    before = _rss_kb()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return {"rss_before_kb": before, "rss_after_kb": _rss_kb()}


def install(app: Any, engine: Any) -> None:
    """Add the /debug/memory routes (only called when KVSERVE_DEBUG_MEMORY is set)."""
    probe = MemoryProbe(trace=os.environ.get(ENV_VAR) == "tracemalloc")

    @app.get("/debug/memory", include_in_schema=False)
    async def debug_memory() -> dict[str, Any]:
        return probe.report(engine)

    @app.post("/debug/memory/trim", include_in_schema=False)
    async def debug_memory_trim() -> dict[str, int]:
        return malloc_trim()
