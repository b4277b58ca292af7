"""Up to how many rows a quantized projection runs the integer kernel, measured on this CPU
(issue 31): the crossover of kernels/cpu/qgemv.py's tiled kernel against the weight
dequantized into a scratch buffer + F.linear (MKL), per shape class (block type, out and in
features, gated or not).

Why measured: the tiled kernel reads 5-8.5 bits a weight where the dequantize path writes
and reads 32, but MKL's fp32 GEMM does more arithmetic per cycle than AVX2's maddubs; where
they cross depends on the CPU, the shape and the threads. On a 2-core AVX2 EPYC the kernel
won everywhere up to 512 rows on the wide projections (gate_up, down) and lost above ~64
rows on the narrow ones (576 -> 576, 576 -> 960) (`kvserve bench kernels --kernel qgemm`).

How: at a projection's first call with more than DECODE_ROWS rows (decode always runs the
integer kernel: 5-7x faster there) both paths are timed on its own weight at the probe rows
of the row buckets 1-3 (16, 64, 256: gemm_select.BUCKETS) with gemm_select.measure (min over
alternating rounds); the crossover is the limit of the last bucket the integer kernel wins
without a loss below it (a bucket above the last probe takes the last probe's choice), so
inf where it wins them all. The result is cached in
$KVSERVE_CACHE_DIR/qgemm-rows.json under gemm_select.cache_key's key (CPU, flags, torch,
threads, shape), marked disturbed where other processes used more than
gemm_select.DISTURBED_CORES cores meanwhile: a later process measures such an entry again
where it finds the machine quiet (gemm_select._quiet), else uses it.

`KVSERVE_QGEMM_ROWS=N` fixes the crossover for every projection (an int, or "inf": the
integer kernel at every row count; 0: the dequantize path from one row): tests and
comparisons.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator

import torch

from kvserve.layers import gemm_select
from kvserve.layers.buckets import BUCKETS
from kvserve.paths import cache_dir

logger = logging.getLogger("kvserve")

QGEMM_ROWS_ENV = "KVSERVE_QGEMM_ROWS"
DECODE_ROWS = 4  # the first row bucket's limit: the integer kernel, never measured
PROBE_BUCKETS = (1, 2, 3)  # the buckets timed (probes of 16, 64 and 256 rows)

_measured: dict[str, float] = {}  # key -> crossover, this process


# Rows forced by `integer_rows` for the projections built inside it (None: not forced).
_forced: list[float | None] = [None]


@contextlib.contextmanager
def integer_rows(on: bool = True) -> Iterator[None]:
    """Deterministic inference (issue 64): the quantized projections built inside run the
    integer kernel at every row count, never MKL on a dequantized copy above a crossover (its
    float steps, and MKL's own for one row against several, differ from the kernel's, so a
    token's logits would depend on how many rows its step had). The kernel quantizes x per
    row and sums each row in a fixed order, so a row's bits depend on that row alone. A
    context, not a process setting: an engine built beside it keeps its measured plan."""
    before = _forced[0]
    if on:
        _forced[0] = float("inf")
    try:
        yield
    finally:
        _forced[0] = before


def env_rows() -> float | None:
    """`integer_rows`'s inf inside it, else $KVSERVE_QGEMM_ROWS as a row count (inf for
    "inf"), None where unset."""
    if _forced[0] is not None:
        return _forced[0]
    v = os.environ.get(QGEMM_ROWS_ENV, "").strip().lower()
    if not v:
        return None
    if v in ("inf", "all"):
        return float("inf")
    try:
        return float(int(v))
    except ValueError:
        raise ValueError(f"{QGEMM_ROWS_ENV} must be a row count or 'inf', got {v!r}") from None


def cache_path():
    return cache_dir() / "qgemm-rows.json"


def _load(key: str) -> tuple[float, bool] | None:
    """(crossover, measured disturbed) cached for `key`."""
    try:
        v = json.loads(cache_path().read_text()).get(key)
        rows, disturbed = float(v["rows"]), bool(v["disturbed"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return (float("inf") if rows >= 1e29 else rows), disturbed


def _store(key: str, rows: float, disturbed: bool) -> None:
    """Best effort (a read-only cache directory only costs a measurement next time)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        data[key] = {"rows": rows if rows != float("inf") else 1e30, "disturbed": disturbed}
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not cache the quantized GEMM crossover in %s: %s", path, e)


def crossover_from(times: dict[str, list[float | None]]) -> float:
    """The row count up to which "int" runs, from per-bucket seconds of "int" and "dequant":
    the limit of the last bucket before the first one "dequant" wins (inf: none)."""
    last = DECODE_ROWS
    for b in range(1, len(BUCKETS)):
        ti, td = times["int"][b], times["dequant"][b]
        if ti is None or td is None:  # past the last probe: its choice
            return float("inf")
        if td < ti:
            return last
        last = BUCKETS[b][0]
    return float("inf")


def crossover(shape: str, k: int, run_int: Callable[[torch.Tensor], object],
              run_dequant: Callable[[torch.Tensor], object]) -> float:
    """The crossover of the projection class `shape` (e.g. "Q4_1 gated 3072x576"), whose in
    features are k: $KVSERVE_QGEMM_ROWS, else this process's or the cache's measurement, else
    measured now on run_int / run_dequant (x float32 [rows, k] -> the projection)."""
    forced = env_rows()
    if forced is not None:
        return forced
    key = gemm_select.cache_key(f"qgemm {shape}", torch.get_num_threads(), {}, torch.__version__)
    if key in _measured:
        return _measured[key]
    cached = _load(key)
    if cached is not None and (not cached[1] or not gemm_select._quiet()):
        _measured[key] = cached[0]
        return cached[0]

    def factory(run: Callable[[torch.Tensor], object]) -> gemm_select.RunFactory:
        def make(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, k)
            return lambda: run(x)
        return make

    others = gemm_select._watch()
    with torch.inference_mode():
        times = gemm_select.measure(
            {shape: {"int": factory(run_int), "dequant": factory(run_dequant)}},
            {shape: max(PROBE_BUCKETS)}, repeats=3, only=PROBE_BUCKETS)[shape]
    busy = others()
    rows = crossover_from(times)
    _measured[key] = rows
    disturbed = busy is not None and busy > gemm_select.DISTURBED_CORES
    _store(key, rows, disturbed)
    logger.info("quantized GEMM %s: integer kernel up to %s rows (us int/dequant at %s: %s)%s",
                shape, rows, [BUCKETS[b][1] for b in PROBE_BUCKETS],
                ", ".join(f"{times['int'][b] * 1e6:.0f}/{times['dequant'][b] * 1e6:.0f}"
                          for b in PROBE_BUCKETS),
                " (disturbed)" if disturbed else "")
    return rows
