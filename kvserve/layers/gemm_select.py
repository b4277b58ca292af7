"""Which GEMM kernel each projection uses at each batch size, chosen by measuring this CPU.

Why: the fastest kernel depends on the CPU and on the number of rows. On a Zen 5 oneDNN with
pre-packed weights ran the projections ~2x faster than `F.linear` (MKL); on an AVX2-only EPYC it
was 1.3-4x *slower* at batch 1 and faster at batch 64 for some shapes; on an AVX-512 Xeon MKL
wins at batch 1 and they are level at prefill sizes. Picking by availability left up to a third
of the CPU's speed on the table, so at load the model times both candidates on its own weights
(`choose`), for each projection and each row bucket, and keeps the faster.

Candidates: "dense" (`F.linear` / `addmm_` on the row-major weight: MKL for float32),
"onednn" (`torch.ops.mkldnn._linear_pointwise` on weights packed in oneDNN's blocked layout,
with SiLU, the SwiGLU product and the residual add fused as epilogues; its row counts are
rounded by `cpu_linear.gemm_rows` so that oneDNN's per-shape kernel cache stays bounded), and
"gemv" (kvserve/kernels/cpu/gemv.py: a C++ matrix-vector kernel on the row-major weight, with bias,
SiLU/GELU * up and the residual add fused; float32, offered for the first row bucket only,
`PARTIAL_KERNELS`), and "panel" (kvserve/kernels/cpu/panel_gemm.py: a C++ GEMM on weights packed
in panels of 32 output features, which streams them from DRAM while it computes; float32,
with bias and the residual add fused).

A projection keeps a second weight layout only where the minority kernel wins its buckets by
at least `MIXED_MIN_GAIN`; otherwise it takes the one kernel that is best over all buckets. The
partial kernels replace it bucket by bucket on the same rule, with two exceptions: the GEMV
beside a row-major weight keeps its bucket unless 10% slower (it adds no layout and enables
the one-call decode path), and the panel GEMM takes a packed kernel's buckets by any margin
where it beats it in all of them (it replaces that layout). A projection left with two
packed layouts drops one where that costs under 10% (`decide`). Results are cached per CPU
model, flags, torch version, threads, dtype and weight shapes in
`$KVSERVE_CACHE_DIR/gemm-choice.json`, so a restart does not measure again (`choose`).
`KVSERVE_KERNEL=dense|onednn` (kernel_choice.override) forces one kernel everywhere (tests, comparisons); `gemv` and
`panel` force theirs where they are offered (`PARTIAL_KERNELS`) and dense elsewhere.

A measurement taken while other processes kept the CPU busy is cached too, with each
projection's cells (projection x row bucket) marked disturbed: one is not worth repeating in
full at every start (~20-60 s of a model's start on a shared machine). A later start on a
quiet machine re-measures a few of those cells (`REFINE_BUDGET_S`), keeps the faster of the
old and new figures (the minimum is the least disturbed), decides again and caches the
result; a cell disturbed `MAX_DISTURBED` times is kept as it is. `remeasure=True` (the
engine's `--remeasure-kernels`) measures everything again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.kernels.cpu.cpu_features import LIBRARY_ISA_ENV, cpu_info, l3_cache_bytes
from kvserve.layers import plan_cache
from kvserve.layers.buckets import BUCKET_LABELS, BUCKETS, bucket_of  # noqa: F401

logger = logging.getLogger("kvserve")

KERNELS = ("dense", "onednn", "gemv", "panel")
# Kernels that read the row-major weight (no second layout when mixed with each other).
ROW_MAJOR = ("dense", "gemv")
PROJECTIONS = ("qkv", "o", "mlp", "down", "head")
# Row buckets: kvserve/layers/buckets.py (BUCKETS, BUCKET_LABELS, bucket_of).
# Kernels offered for some row buckets only (their factories return None for the others): they
# never make a projection's single choice, they replace it in the buckets where they win. The
# GEMV only for a few rows; the panel GEMM above them, where the GEMV (and the one-call decode
# path it enables, fast_decode.FastDecode, which no per-GEMM timing sees) is the better choice.
# Not the panel GEMM for prefills above 512 rows: there its row blocks stream every weight from
# the L3 once per 192 rows, and at 8,192 rows it ran 6-18% behind oneDNN and MKL (bench_throughput's
# ceiling), though level with them at the bucket's 1,000-row probe, where a coin toss chose it.
PARTIAL_KERNELS = {"gemv": (0, 0), "panel": (1, 3)}  # kernel -> first, last bucket
MIXED_MIN_GAIN = 0.10  # keep two weight layouts only for a >= 10% gain
UNKNOWN_L3_BYTES = 32 << 20  # a last-level cache sysfs does not report: a typical size
DISTURBED_CORES = 0.5  # other processes' CPU use above which a measurement is disturbed
MAX_DISTURBED = 3  # a cell measured disturbed this many times is kept as it is
REFINE_BUDGET_S = 0.5  # seconds of re-measuring disturbed cells per start (at least one cell)
QUIET_PROBE_S = 0.1  # how long a start watches the CPU before it re-measures anything
CACHE_FILE = "gemm-choice.json"  # under $KVSERVE_CACHE_DIR (plan_cache)
CACHE_VERSION = 11  # 3: head GEMV timed as bound; 4: panel GEMM; 5, 6: fewer layouts; 7: GEMV
# ties; 8: cold timing (weights_stream); 9: the panel GEMM's AVX2/SSE tiles (half / quarter
# panels); 10: the panel GEMM's norm and gated-activation epilogues; 11: disturbed cells cached

# factory(rows) -> a zero-argument callable running the projection once on `rows` rows (None
# where the kernel is not offered for that many rows)
RunFactory = Callable[[int], Callable[[], object] | None]


@dataclass
class GemmPlan:
    """kernels[projection][bucket] in KERNELS; times_us[projection][kernel][bucket] measured
    (empty when forced). disturbed[projection][bucket]: how many times that cell was measured
    while the machine was busy, 0 once it was measured quiet (see `choose`); cost_s: the
    seconds its last measurement took (what re-measuring it costs)."""

    kernels: dict[str, list[str]]
    source: str  # "measured" or "cached" (", disturbed" / ", refined ..."), or "forced"
    times_us: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    disturbed: dict[str, list[int]] = field(default_factory=dict)
    cost_s: dict[str, list[float | None]] = field(default_factory=dict)

    def due(self) -> list[tuple[str, int]]:
        """The cells to re-measure: measured disturbed, fewer than MAX_DISTURBED times."""
        return [(p, b) for p, ns in self.disturbed.items() for b, n in enumerate(ns)
                if 0 < n < MAX_DISTURBED]

    def uses(self, projection: str, kernel: str) -> bool:
        return kernel in self.kernels[projection]

    def describe(self) -> str:
        """e.g. 'qkv dense/dense/onednn/onednn/onednn; o dense; ...' (one kernel per bucket of
        BUCKET_LABELS where they differ)."""
        return "; ".join(f"{p} {'/'.join(ks) if len(set(ks)) > 1 else ks[0]}"
                         for p in PROJECTIONS for ks in [self.kernels[p]])


def forced_plan(kernel: str) -> GemmPlan:
    """`kernel` for every projection and bucket (a partial kernel where it is offered, dense
    elsewhere)."""
    if kernel not in KERNELS:
        raise ValueError(f"GEMM kernel must be one of {KERNELS}, got {kernel!r}")
    per_bucket = [kernel if offered(kernel, b) else "dense" for b in range(len(BUCKETS))]
    return GemmPlan({p: list(per_bucket) for p in PROJECTIONS}, "forced")


def offered(kernel: str, bucket: int) -> bool:
    """Whether `kernel` is a candidate for row bucket `bucket` (PARTIAL_KERNELS)."""
    first, last = PARTIAL_KERNELS.get(kernel, (0, len(BUCKETS) - 1))
    return first <= bucket <= last


def time_once(run: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - t0) / calls


def measure(factories: dict[str, dict[str, RunFactory]], max_bucket: dict[str, int],
            repeats: int = 5, target_s: float = 1e-3,
            evict: Callable[[], object] | None = None, cold: Sequence[bool] = (),
            only: Sequence[int] | None = None, walls: dict[str, list] | None = None
            ) -> dict[str, dict[str, list[float | None]]]:
    """Seconds per call, min over `repeats` alternating rounds (the minimum is the figure least
    disturbed by other processes), for each projection, kernel and bucket up to
    max_bucket[projection] (and in `only`, where given). Each sample runs as many calls as
    fill about `target_s` (from the first, warm-up call), at most 20, so the whole measurement
    stays near a second. In the buckets where cold[bucket] (see `weights_stream`) each sample
    is one call after evict() (`cache_evictor`): the weights come from DRAM, as in an engine
    whose step streams more than the cache holds. `walls` receives each measured bucket's
    seconds, walls[projection][bucket]."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for proj, per_kernel in factories.items():
        out[proj] = {k: [None] * len(BUCKETS) for k in per_kernel}
        for b, (_, rows) in enumerate(BUCKETS):
            if b > max_bucket[proj]:
                break
            if only is not None and b not in only:
                continue
            t0 = time.perf_counter()
            runs = {k: run for k, f in per_kernel.items() if (run := f(rows)) is not None}
            for run in runs.values():
                run()  # compile / first touch
            first = min(time_once(run, 1) for run in runs.values())
            evicting = evict is not None and b < len(cold) and cold[b]
            calls = 1 if evicting else max(1, min(20, int(target_s / max(first, 1e-7))))
            best = {k: float("inf") for k in runs}
            for r in range(repeats):
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for k in order:
                    if evicting:
                        evict()
                    best[k] = min(best[k], time_once(runs[k], calls))
            for k in runs:
                out[proj][k][b] = best[k]
            if walls is not None:
                walls.setdefault(proj, [None] * len(BUCKETS))[b] = time.perf_counter() - t0
    return out


def decide(times: dict[str, dict[str, list[float | None]]]) -> dict[str, list[str]]:
    """Per projection: among the kernels offered for every bucket, the faster kernel per
    bucket where that gains >= MIXED_MIN_GAIN in every bucket the minority wins, else the
    single kernel with the lowest summed relative cost; buckets past the last measured one
    take its choice. Then a partial kernel (gemv, panel) takes the buckets where it is faster:
    the GEMV unless it is MIXED_MIN_GAIN slower where the projection keeps its row-major
    weight anyway; else by MIXED_MIN_GAIN (it adds a weight layout), or by any margin where it
    replaces a packed layout in all of its buckets (`_take_over`). Buckets past the last
    measured one take that bucket's choice. Last, a projection left with two packed layouts
    (oneDNN's and the panel GEMM's) drops one where the other kernels come within
    MIXED_MIN_GAIN of it in every bucket it holds (`_fewer_layouts`)."""
    kernels: dict[str, list[str]] = {}
    for proj, per_kernel in times.items():
        full = {k: v for k, v in per_kernel.items() if k not in PARTIAL_KERNELS}
        kernels[proj] = _decide_full(full)
        chosen = kernels[proj]
        last = max((b for ts in per_kernel.values() for b, t in enumerate(ts) if t is not None),
                   default=len(BUCKETS) - 1)
        for k, ts in per_kernel.items():
            if k not in PARTIAL_KERNELS:
                continue
            if k not in ROW_MAJOR:
                _take_over(chosen, per_kernel, k, last)
            # The GEMV beside a row-major kernel adds no layout, and it enables the one-call
            # decode path (fast_decode.FastDecode: ~13% of a batch-1 step) that no per-GEMM
            # timing sees: it keeps its buckets unless it is MIXED_MIN_GAIN slower. (With
            # "any margin" a noisy measurement could hand one projection to MKL at one row and
            # turn that path off.)
            gain = -MIXED_MIN_GAIN if k in ROW_MAJOR and any(c in ROW_MAJOR for c in chosen) \
                else MIXED_MIN_GAIN
            for b, t in enumerate(ts):
                other = per_kernel.get(chosen[b], [None] * len(BUCKETS))[b]
                if t is None or other is None:
                    continue
                if other >= (1 + gain) * t:
                    chosen[b] = k
        chosen[last + 1:] = [chosen[last]] * (len(BUCKETS) - last - 1)
        _fewer_layouts(chosen, per_kernel)
    return kernels


def _take_over(chosen: list[str], per_kernel: dict[str, list[float | None]], kernel: str,
               last: int) -> None:
    """In place: give packed partial `kernel` every bucket of a packed kernel it beats, by any
    margin, in all of that kernel's buckets up to `last` (the last measured one): it then
    replaces that weight layout instead of adding one, so MIXED_MIN_GAIN does not apply."""
    ts = per_kernel[kernel]
    for packed in {c for c in chosen if c not in ROW_MAJOR and c != kernel}:
        held = [b for b, c in enumerate(chosen) if c == packed and b <= last]
        theirs = per_kernel[packed]
        if held and all(ts[b] is not None and theirs[b] is not None and ts[b] < theirs[b]
                        for b in held):
            for b, c in enumerate(chosen):
                if c == packed:
                    chosen[b] = kernel


def _fewer_layouts(chosen: list[str], per_kernel: dict[str, list[float | None]]) -> None:
    """In place: where `chosen` uses both packed layouts, hand the buckets of the one that
    costs least to give up to the fastest other kernel in each, if that is within
    MIXED_MIN_GAIN of it everywhere. Why: a third copy of a weight (row-major for the GEMV,
    panels, oneDNN's) for a few percent in some buckets is a poor trade of memory."""
    packed = [k for k in KERNELS if k not in ROW_MAJOR and k in chosen]
    if len(packed) < 2:
        return
    for drop in sorted(packed, key=lambda k: chosen.count(k)):
        plan = list(chosen)
        for b, k in enumerate(chosen):
            if k != drop:
                continue
            t = per_kernel[drop][b]
            others = {o: ts[b] for o, ts in per_kernel.items()
                      if o != drop and ts[b] is not None and (o in ROW_MAJOR or o in chosen)}
            if t is None or not others:
                break
            best = min(others, key=others.get)
            if others[best] > (1 + MIXED_MIN_GAIN) * t:
                break
            plan[b] = best
        else:
            chosen[:] = plan
            return


def _decide_full(per_kernel: dict[str, list[float | None]]) -> list[str]:
    """decide() for one projection's kernels that are offered for every bucket."""
    names = list(per_kernel)
    measured = [b for b in range(len(BUCKETS))
                if all(per_kernel[k][b] is not None for k in names)]
    if len(names) == 1 or not measured:
        return [names[0]] * len(BUCKETS)
    best = {b: min(names, key=lambda k: per_kernel[k][b]) for b in measured}
    rel = {k: sum(per_kernel[k][b] / per_kernel[best[b]][b] for b in measured)
           for k in names}
    single = min(names, key=lambda k: rel[k])
    mixed_ok = all(
        best[b] == single
        or per_kernel[single][b] >= (1 + MIXED_MIN_GAIN) * per_kernel[best[b]][b]
        for b in measured)
    per_bucket = [best[b] if mixed_ok else single for b in measured]
    per_bucket += [per_bucket[-1]] * (len(BUCKETS) - len(per_bucket))
    return per_bucket


# -- cache ------------------------------------------------------------------------------------
def cache_path() -> Path:
    return plan_cache.path_of(CACHE_FILE)


def cache_key(dtype: str, threads: int, shapes: dict[str, tuple[int, int]],
              torch_version: str, cold: Sequence[bool] = ()) -> str:
    info = cpu_info()
    flags = ",".join(sorted(f for f in info.flags if f.startswith(("avx", "amx", "fma"))))
    shape_s = ",".join(f"{p}={o}x{i}" for p, (o, i) in sorted(shapes.items()))
    # the libraries' own instruction-set caps (cpu_features.isa_cap_env) change their speed
    caps = ",".join(f"{v}={os.environ[v]}" for v in LIBRARY_ISA_ENV if os.environ.get(v))
    return (f"v{CACHE_VERSION}|{info.model_name}|{flags}|torch {torch_version}|"
            f"threads {threads}|{dtype}|{shape_s}"
            + (f"|cold {''.join('1' if c else '0' for c in cold)}" if any(cold) else "")
            + (f"|isa {caps}" if caps else ""))


def weights_stream(weight_bytes: int, l3_bytes: int | None, bucket: int) -> bool:
    """Whether a running engine reads the model's projection weights from DRAM at the row
    counts of `bucket`. A step reads the weights and the K/V of every running sequence. At a
    few rows (bucket 0) the K/V is small, and weights that fit in the last-level cache are
    read from it at every step (the reference model's 156 MB in a 260 MiB L3: batch 1 runs
    at ~53 GB/s, twice the DRAM copy speed). At more rows (at batch 64 the K/V is as much
    again as the reference model's weights) weights that fill more than half the cache do
    not survive from one step to the next. An unknown cache size counts as UNKNOWN_L3_BYTES."""
    l3 = l3_bytes or UNKNOWN_L3_BYTES
    return weight_bytes > l3 if bucket == 0 else 2 * weight_bytes > l3


def cache_evictor(l3_bytes: int | None, max_bytes: int = 1 << 30) -> Callable[[], object]:
    """A call that pushes the timed weights out of the caches by reading a buffer the size of
    the L3 (UNKNOWN_L3_BYTES where unknown; at most max_bytes), so that a sample times the kernel on
    weights from DRAM. Why: kernels differ in how they bear that. At 64 rows on an AVX-512
    Xeon, oneDNN lost 5-76% and the panel GEMM 3-33% against a hot loop; hot timings had the
    LM head on oneDNN by a coin toss, ~13% slower in the engine than the panel GEMM."""
    import torch  # deferred: nothing else here needs it

    size = min(l3_bytes or UNKNOWN_L3_BYTES, max_bytes)
    buf = torch.ones(size // 4)
    return lambda: buf.sum()


def load_cached(key: str) -> GemmPlan | None:
    entry = plan_cache.read(CACHE_FILE, key)
    if not isinstance(entry, dict) or set(entry.get("kernels", {})) != set(PROJECTIONS):
        return None
    kernels = entry["kernels"]
    if any(len(v) != len(BUCKETS) or set(v) - set(KERNELS) for v in kernels.values()):
        return None
    disturbed = {p: [int(n) for n in ns] for p, ns in entry.get("disturbed", {}).items()
                 if p in PROJECTIONS and len(ns) == len(BUCKETS)}
    return GemmPlan(kernels, "cached", entry.get("times_us", {}), disturbed,
                    entry.get("cost_s", {}))


def store_cached(key: str, plan: GemmPlan) -> None:
    """Best effort (plan_cache.write)."""
    plan_cache.write(CACHE_FILE, key, {"kernels": plan.kernels, "times_us": plan.times_us,
                                       "disturbed": plan.disturbed, "cost_s": plan.cost_s})


def _busy_cpu_s() -> float | None:
    """CPU seconds all processes have used (from /proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _watch() -> Callable[[], float | None]:
    """Start watching the CPU; the returned call gives the cores other processes kept busy on
    average since then (None off Linux)."""
    t0, busy0, own0 = time.perf_counter(), _busy_cpu_s(), time.process_time()

    def others() -> float | None:
        busy1, own = _busy_cpu_s(), time.process_time() - own0
        wall = time.perf_counter() - t0
        if busy0 is None or busy1 is None or wall <= 0:
            return None
        return max(busy1 - busy0 - own, 0) / wall
    return others


def _quiet() -> bool:
    """Whether other processes leave the CPU alone now (QUIET_PROBE_S of watching)."""
    others = _watch()
    time.sleep(QUIET_PROBE_S)
    busy = others()
    return busy is None or busy <= DISTURBED_CORES


def _pick(plan: GemmPlan) -> dict[str, list[int]]:
    """The due cells to re-measure at this start: the cheapest first (by their last
    measurement's seconds), as many as REFINE_BUDGET_S allows, at least one."""
    def cost(cell: tuple[str, int]) -> float:
        c = plan.cost_s.get(cell[0], [None] * len(BUCKETS))[cell[1]]
        return REFINE_BUDGET_S if c is None else c

    picked: dict[str, list[int]] = {}
    spent = 0.0
    for cell in sorted(plan.due(), key=cost):
        if picked and spent + cost(cell) >= REFINE_BUDGET_S:
            break
        picked.setdefault(cell[0], []).append(cell[1])
        spent += cost(cell)
    return picked


def _measure_into(plan: GemmPlan, factories: dict[str, dict[str, RunFactory]],
                  cells: dict[str, list[int]], max_bucket: dict[str, int],
                  evict: Callable[[], Callable[[], object]] | None, cold: Sequence[bool]
                  ) -> bool:
    """Measure `cells` (projection -> buckets) and fold them into `plan` in place: each time
    the faster of the old and new figure, each cell's disturbed count 0 where its
    projection's measurement was quiet, else one more. Returns whether any was disturbed."""
    evicting = evict() if evict and any(b < len(cold) and cold[b]
                                        for bs in cells.values() for b in bs) else None
    any_disturbed = False
    for proj, buckets in cells.items():
        others, walls = _watch(), {}
        times = measure({proj: factories[proj]}, max_bucket, evict=evicting, cold=cold,
                        only=buckets, walls=walls)[proj]
        busy = others()
        disturbed = busy is not None and busy > DISTURBED_CORES
        any_disturbed |= disturbed
        logger.debug("GEMM choice: %s buckets %s measured in %.2f s (other processes: %s "
                     "cores)", proj, buckets, sum(w for w in walls.get(proj, []) if w),
                     "?" if busy is None else f"{busy:.2f}")
        old = plan.times_us.setdefault(proj, {})
        counts = plan.disturbed.setdefault(proj, [0] * len(BUCKETS))
        costs = plan.cost_s.setdefault(proj, [None] * len(BUCKETS))
        for b in buckets:
            for k, ts in times.items():
                row = old.setdefault(k, [None] * len(BUCKETS))
                if ts[b] is not None:
                    us = round(ts[b] * 1e6, 2)
                    row[b] = us if row[b] is None else min(row[b], us)
            counts[b] = counts[b] + 1 if disturbed else 0
            wall = walls.get(proj, [None] * len(BUCKETS))[b]
            costs[b] = None if wall is None else round(wall, 3)
    plan.kernels = decide({p: {k: [None if t is None else t / 1e6 for t in ts]
                               for k, ts in per.items()} for p, per in plan.times_us.items()})
    return any_disturbed


def choose(key: str, factories: dict[str, dict[str, RunFactory]]
           | Callable[[], dict[str, dict[str, RunFactory]]],
           max_bucket: dict[str, int],
           evict: Callable[[], Callable[[], object]] | None = None,
           cold: Sequence[bool] = (), remeasure: bool = False) -> GemmPlan:
    """The cached plan for `key`, else measure, decide, cache and return it. `factories` (or
    a call that builds them: only when something is measured); `evict` makes the evicting
    call for `measure`'s `cold` buckets (built only when a cold bucket is measured).

    A measurement during which other processes kept more than DISTURBED_CORES cores busy is
    cached with its projection's cells marked disturbed (source "measured, disturbed"). A
    cached plan with such cells is used at once; on a quiet machine (`_quiet`) the cheapest
    few are measured again first (`_pick`, about REFINE_BUDGET_S), merged, decided again
    and cached (source "cached, refined ..."); never the whole measurement again.
    `remeasure`: ignore the cache, measure everything and cache that."""
    build = factories if callable(factories) else (lambda: factories)
    plan = None if remeasure else load_cached(key)
    if plan is not None:
        cells = _pick(plan)
        if not cells:
            return plan
        if not _quiet():
            plan.source = "cached, disturbed"
            return plan
        disturbed = _measure_into(plan, build(), cells, max_bucket, evict, cold)
        n = sum(map(len, cells.values()))
        plan.source = f"cached, refined {n} disturbed cell{'s' if n > 1 else ''}" \
            + (" (disturbed again)" if disturbed else "")
    else:
        t0 = time.perf_counter()
        built = build()
        plan = GemmPlan({}, "measured")
        cells = {p: list(range(max_bucket[p] + 1)) for p in built}
        if _measure_into(plan, built, cells, max_bucket, evict, cold):
            plan.source = "measured, disturbed"
        logger.debug("GEMM choice measured in %.2f s", time.perf_counter() - t0)
    store_cached(key, plan)
    return plan


def model_plan(factories: Callable[[], dict[str, dict[str, RunFactory]]],
               shapes: dict[str, tuple[int, int]], num_layers: int, element_size: int,
               dtype: str, remeasure: bool = False) -> GemmPlan:
    """The plan of a decoder of `num_layers` layers with projections `shapes` (out, in
    features; "head" the LM head's), by `choose` on factories() (layer 0's weights and the LM
    head: selection.gemm_candidates), under the key of this CPU, threads and shapes."""
    import torch  # deferred: nothing else here needs it

    # the LM head runs on sampled rows only (<= max_num_seqs): measured up to 128 rows
    max_bucket = {k: len(BUCKETS) - 1 for k in shapes}
    max_bucket["head"] = bucket_of(128)
    # every layer's projections and the LM head, as one decode step reads them
    per_layer = sum(o * i for p, (o, i) in shapes.items() if p != "head")
    head_out, head_in = shapes["head"]
    weight_bytes = (num_layers * per_layer + head_out * head_in) * element_size
    l3 = l3_cache_bytes()
    cold = [weights_stream(weight_bytes, l3, b) for b in range(len(BUCKETS))]
    key = cache_key(dtype, torch.get_num_threads(), shapes, torch.__version__, cold)
    with torch.inference_mode():
        return choose(key, factories, max_bucket, lambda: cache_evictor(l3), cold, remeasure)
