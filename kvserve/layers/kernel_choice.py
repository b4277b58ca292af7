"""The one kernel choice of a quantized projection, made at load (issue 65): `choose(format,
shape, dtype, isa)` returns a `KernelChoice` (the kernel, the layout its weights are repacked
into, and up to how many rows it runs), like llama.cpp's one repack choice per tensor type x
ISA x shape; `KernelChoice.kernel_at(rows)` is the kernel of a row count (a row bucket's).
`measured` fills in the one part that is measured, at load; nothing is measured later.

The layout: row tiles of 16 output features (csrc/qtiles*.h) where the build's tile kernel
pays for the type (QGemv.tiles_pay: the AVX-512 VNNI kernel, at 32 rows 2.5-3.5x the row
layout's speed on a Zen 4 EPYC, batch 1 no slower; the AVX2 one 2.0-2.4x) and the shape has
tiles, else the file's rows.

The rows (issue 31): up to `int_rows` rows the integer kernel (kernels/cpu/qgemv.py) runs;
above, F.linear (MKL) on the weight dequantized into a scratch buffer ("dequant"). The tiled
kernel reads 5-8.5 bits a weight where the dequantize path writes and reads 32, but MKL's
fp32 GEMM does more arithmetic per cycle than AVX2's maddubs; where they cross depends on
the CPU, the shape and the threads. On a 2-core AVX2 EPYC the kernel won everywhere up to
512 rows on the wide projections (gate_up, down) and lost above ~64 rows on the narrow ones
(576 -> 576, 576 -> 960). So: inf on row tiles on the AVX-512 tile kernel (at 16-512 rows it
ran 1.6-2x MKL on the weight already dequantized, every SmolLM2 shape: nothing to measure);
else measured at load, once per shape class, by `measured`: both paths timed on the
projection's own weight at the probe rows of row buckets 1-3 (16, 64, 256) with
gemm_select.measure; the crossover is the limit of the last bucket the integer kernel wins
without a loss below it (`crossover_from`). Cached through plan_cache in "qgemm-rows.json"
under gemm_select.cache_key's key, marked disturbed where other processes used the CPU
meanwhile (measured again where a later load finds the machine quiet).

One override, $KVSERVE_KERNEL (tests and comparisons): comma-separated items, `gemm=K` (or a
bare K) forces the float GEMM plan's kernel K in dense|onednn|gemv|panel|auto
(gemm_select), `qlayout=tiles|rows` the quantized weights' layout (tiles where the shape has
them), `qrows=N|inf` the integer kernel's rows for every quantized projection (0: the
dequantized copy from one row). `integer_rows` (deterministic inference, issue 64) is qrows=inf
for the models built inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from kvserve.kernels.cpu import qgemv
from kvserve.layers import gemm_select, plan_cache
from kvserve.layers.buckets import BUCKETS

logger = logging.getLogger("kvserve")

KERNEL_ENV = "KVSERVE_KERNEL"
DECODE_ROWS = 4  # the first row bucket's limit: the integer kernel, never measured
PROBE_BUCKETS = (1, 2, 3)  # the buckets timed (probes of 16, 64 and 256 rows)
CACHE_FILE = "qgemm-rows.json"  # under $KVSERVE_CACHE_DIR (plan_cache)
GEMM_KERNELS = ("auto", *gemm_select.KERNELS)
LAYOUTS = ("rows", "tiles")

Run = Callable[[torch.Tensor], object]  # x float32 [rows, k] -> the projection


@dataclass(frozen=True)
class Override:
    """What $KVSERVE_KERNEL (and `integer_rows`) force; None: chosen."""

    gemm: str | None = None
    layout: str | None = None
    rows: float | None = None


_forced_rows: list[float | None] = [None]  # set by `integer_rows`
_measured: dict[str, float] = {}  # cache key -> crossover, this process


@contextlib.contextmanager
def integer_rows(on: bool = True) -> Iterator[None]:
    """Deterministic inference (issue 64): the quantized projections built inside run the
    integer kernel at every row count, never MKL on a dequantized copy above a crossover (its
    float steps, and MKL's own for one row against several, differ from the kernel's, so a
    token's logits would depend on how many rows its step had). The kernel quantizes x per
    row and sums each row in a fixed order, so a row's bits depend on that row alone. A
    context, not a process setting: an engine built beside it keeps its measured choice."""
    before = _forced_rows[0]
    if on:
        _forced_rows[0] = float("inf")
    try:
        yield
    finally:
        _forced_rows[0] = before


def _rows_value(v: str) -> float:
    if v in ("inf", "all"):
        return float("inf")
    try:
        return float(int(v))
    except ValueError:
        raise ValueError(f"{KERNEL_ENV}: qrows must be a row count or 'inf', got {v!r}") from None


def override() -> Override:
    """$KVSERVE_KERNEL parsed (see the module docstring), with `integer_rows`'s inf rows
    inside it; raises ValueError naming the variable on an item it does not know."""
    gemm = layout = rows = None
    items = (s.strip().lower() for s in os.environ.get(KERNEL_ENV, "").split(","))
    for item in filter(None, items):
        name, _, value = item.rpartition("=")
        name = name.strip() or "gemm"
        value = value.strip()
        if name == "gemm" and value in GEMM_KERNELS:
            gemm = value
        elif name == "qlayout" and value in LAYOUTS:
            layout = value
        elif name == "qrows":
            rows = _rows_value(value)
        else:
            raise ValueError(f"{KERNEL_ENV}: unknown item {item!r} (gemm=" +
                             "|".join(GEMM_KERNELS) + ", qlayout=tiles|rows, qrows=N|inf)")
    if _forced_rows[0] is not None:
        rows = _forced_rows[0]
    return Override(gemm, layout, rows)


@dataclass(frozen=True)
class KernelChoice:
    """A quantized weight's kernel: `kernel` ("qtiles", the tile kernel, or "qgemv", the row
    kernel; "+"-joined over a stacked weight's parts), the `layout` its blocks are repacked
    into ("tiles" or "rows", likewise joined), and `int_rows`: the integer kernel up to that
    many rows, F.linear on a dequantized copy above (None: still to be `measured`)."""

    kernel: str
    layout: str
    int_rows: float | None

    def kernel_at(self, rows: int) -> str:
        """The kernel a call of `rows` rows runs ("dequant": F.linear on the dequantized
        weight)."""
        if self.int_rows is None:
            raise ValueError("the crossover of this choice is measured at load (`measured`)")
        return self.kernel if rows <= self.int_rows else "dequant"


def choose(fmt: str, shape: tuple[int, int], dtype: str = "float32",
           isa: str | None = None, layout: str | None = None) -> KernelChoice:
    """The kernel and layout of a weight of block type `fmt` and `shape` (n, k), x in `dtype`
    ("float32": quantized to 8 bits per block; "float-x": kept in float32, Q8_0 only; both
    run either layout) on the kernel build for `isa` (None: this machine's; a process runs
    one build, cpu_features caps it). int_rows: the override's, inf on native tiles, else
    None (`measured` at load). `layout`: the one a weight made elsewhere already has (a
    test's, a benchmark's), not chosen."""
    if dtype not in ("float32", "float-x"):
        raise ValueError(f"quantized kernels take float32 activations, not {dtype}")
    kernel = qgemv.load()
    forced = override()
    if kernel is None:  # nothing runs blocks here (the loader keeps no weight as blocks)
        return KernelChoice("none", "rows", forced.rows)
    if isa is not None and isa != kernel.isa:
        raise ValueError(f"this process runs the {kernel.isa} kernels, not {isa}")
    layout = layout or forced.layout
    wanted = kernel.tiles_pay(fmt) if layout is None else layout == "tiles"
    tiled = wanted and qgemv.tileable(fmt, *shape)
    rows = forced.rows if forced.rows is not None \
        else float("inf") if tiled and kernel.tiles_native else None
    return KernelChoice("qtiles" if tiled else "qgemv", "tiles" if tiled else "rows", rows)


def stacked(choices: Sequence[KernelChoice]) -> KernelChoice:
    """The choice of a weight made of parts (StackedQuantWeight): their kernels and layouts,
    the integer kernel up to the fewest rows any part has (None where any is measured)."""
    rows = [c.int_rows for c in choices]
    return KernelChoice("+".join(c.kernel for c in choices), "+".join(c.layout for c in choices),
                        None if None in rows else min(rows))


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


def _cached(key: str) -> float | None:
    """The crossover cached for `key` (None: none, or measured disturbed and the machine is
    quiet now, so measured again)."""
    entry = plan_cache.read(CACHE_FILE, key)
    try:
        rows, disturbed = float(entry["rows"]), bool(entry["disturbed"])
    except (KeyError, TypeError, ValueError):
        return None
    if disturbed and gemm_select._quiet():
        return None
    return float("inf") if rows >= 1e29 else rows


def measured(choice: KernelChoice, shape_class: str, k: int, run_int: Run,
             run_dequant: Run) -> KernelChoice:
    """`choice` with its int_rows (where still None): this process's or the cache's
    crossover of `shape_class` (e.g. "Q4_1 tiles gated 3072x576"), else measured now on
    run_int / run_dequant (a few hundred ms; once per shape class, logged)."""
    if choice.int_rows is not None:
        return choice
    key = gemm_select.cache_key(f"qgemm {shape_class}", torch.get_num_threads(), {},
                                torch.__version__)
    if key not in _measured:
        cached = _cached(key)
        _measured[key] = cached if cached is not None else _measure(key, shape_class, k,
                                                                    run_int, run_dequant)
    return replace(choice, int_rows=_measured[key])


def _measure(key: str, shape_class: str, k: int, run_int: Run, run_dequant: Run) -> float:
    def factory(run: Run) -> gemm_select.RunFactory:
        def make(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, k)
            return lambda: run(x)
        return make

    others = gemm_select._watch()
    with torch.inference_mode():
        times = gemm_select.measure(
            {shape_class: {"int": factory(run_int), "dequant": factory(run_dequant)}},
            {shape_class: max(PROBE_BUCKETS)}, repeats=3, only=PROBE_BUCKETS)[shape_class]
    busy = others()
    rows = crossover_from(times)
    disturbed = busy is not None and busy > gemm_select.DISTURBED_CORES
    plan_cache.write(CACHE_FILE, key, {"rows": rows if rows != float("inf") else 1e30,
                                       "disturbed": disturbed})
    logger.info("quantized GEMM %s: integer kernel up to %s rows (us int/dequant at %s: %s)%s",
                shape_class, rows, [BUCKETS[b][1] for b in PROBE_BUCKETS],
                ", ".join(f"{times['int'][b] * 1e6:.0f}/{times['dequant'][b] * 1e6:.0f}"
                          for b in PROBE_BUCKETS),
                " (disturbed)" if disturbed else "")
    return rows
