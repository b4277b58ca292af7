"""Chooses a model's methods before it is built (`plan_for`: the `ExecutionPlan` its
constructors receive), measures the CPU's GEMM plan for it (`measure_gemms`), resolves the
dtype a load runs in (`resolve_dtype`), and warms oneDNN's shapes up (`warm_up_steps`).

Nothing here touches a built model's methods: the layers take theirs from the plan
(`kvserve.layers.plan`, `cpu_methods`) and make them from their weights after loading. The
candidates the plan is measured on are made here (`gemm_candidates`), from the same ops the
layers then run, on a scratch layer of the model's shapes with random weights (built before
the model, so the measurement's copies are gone before the model's weights are allocated).

On the CPU each projection and the LM head get the GEMM kernel that measures fastest on this
CPU for each row bucket (gemm_select.py): `F.linear` (MKL in float32), oneDNN on weights
packed in its blocked layout with the gate's SiLU (or GELU-tanh), the gated product and the
residual add as fused epilogues, the panel GEMM or the GEMV (kernels/cpu/). Which wins
depends on the CPU and the batch: on a Zen 5 oneDNN was ~2x faster at every size; on an
AVX-512 Xeon MKL wins at batch 1; on an AVX2 EPYC oneDNN loses at batch 1 and wins at batch
64 for some shapes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from kvserve.utils.dtypes import DTYPES, canonical_dtype, to_torch_dtype
from kvserve.kernels.cpu import gemv, panel_gemm, qgemv
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.layers import gemm_select
from kvserve.layers.block import PROJECTIONS as _PROJS
from kvserve.layers.buckets import bucket_of
from kvserve.layers.cpu_layer_ops import kernel_ops, wrap_unfused
from kvserve.layers.cpu_linear import (gemm_rows, gemv_available, onednn_available,
                                       onednn_linear, onednn_pack)
from kvserve.layers.cpu_methods import CpuMethods, mla_kernel
from kvserve.layers.gemm_select import GemmPlan
from kvserve.layers.linear import Dense
from kvserve.layers.plan import ExecutionPlan, MethodSource, TensorParallel

logger = logging.getLogger("kvserve")


# -- a DecoderLayer's kernels per row bucket ------------------------------------------------
def layer_candidates(layer: Any, layer_ops: bool = True
                     ) -> dict[str, dict[str, gemm_select.RunFactory]]:
    """For each projection and kernel, a factory(rows) -> run-once callable on `layer`'s own
    weights (packed copies made here and dropped after): what `gemm_select` times. Call
    on dense weights (a scratch layer's, or a model loaded with the dense plan).

    layer_ops: time each kernel's projection as the layer runs it (qkv with the input norm
    and RoPE around it, gate/up with the post-attention norm): the GEMV and the panel GEMM
    norm in their own calls, the other kernels run the norms as separate ops, and the
    choice should see that. False: the GEMMs alone (the benchmarks' GEMM ceiling). Each
    kernel's ops (and packed copies) are made when a factory of it is first called."""
    p = {"dtype": layer.qkv_proj.weight.dtype, "device": layer.qkv_proj.weight.device}
    kernels = ["dense"]
    if onednn_available(**p):
        kernels.append("onednn")
    if gemv_available(**p):
        kernels.append("gemv")
    if panel_gemm.available(**p):
        kernels.append("panel")
    built: dict[str, dict[str, Callable]] = {}
    h, q = layer.qkv_proj.weight.shape[1], layer.q_size

    def factory(kind: str, kernel: str) -> gemm_select.RunFactory:
        def make(rows: int) -> Callable[[], object] | None:
            if not gemm_select.offered(kernel, bucket_of(rows)):
                return None
            if kernel not in built:
                built[kernel] = kernel_ops(layer, kernel, fused=layer_ops)
                if layer_ops:
                    wrap_unfused(layer, kernel, built[kernel])
            ops = built[kernel]
            x = torch.randn(rows, h, **p)
            if kind == "qkv" and layer_ops:
                cos_sin = torch.rand(rows, layer.head_dim, **p)
                return lambda: ops["qkv"](x, cos_sin)
            if kind == "qkv":
                return lambda: ops["qkv"](x)
            if kind == "o":
                xo, r = torch.randn(rows, q, **p), torch.zeros(rows, h, **p)
                return lambda: ops["o"](xo, r)
            if kind == "mlp":
                return lambda: ops["mlp"](x)
            xd = torch.randn(rows, layer.intermediate_size, **p)
            r = torch.zeros(rows, h, **p)
            return lambda: ops["down"](xd, r)
        return make

    return {kind: {k: factory(kind, k) for k in kernels} for kind in _PROJS}


def gemm_candidates(layer: Any, head: torch.Tensor, layer_ops: bool = True
                    ) -> dict[str, dict[str, gemm_select.RunFactory]]:
    """projection -> kernel -> factory(rows) -> run-once callable, on `layer`'s weights (a
    DecoderLayer with dense weights) and the LM head's `head` [vocab, hidden] (oneDNN-packed
    copies made here): what `gemm_select` times, and what benchmarks time for the machine's
    GEMM ceiling (`layer_ops`: see layer_candidates)."""
    h = head.shape[1]
    factories = layer_candidates(layer, layer_ops)
    # made at a factory's first call; the C++ ones bound once, as PlannedHead binds them (the
    # checked call costs ~10 us more)
    makers = {"onednn": lambda: onednn_pack(head), "gemv": lambda: gemv.load().bind(head),
              "panel": lambda: panel_gemm.load().bind(panel_gemm.load().pack(head))}
    made: dict[str, Callable] = {}
    p = {"dtype": head.dtype, "device": head.device}
    dense = Dense(head)

    def head_run(kind: str) -> gemm_select.RunFactory:
        def make(rows: int) -> Callable[[], object] | None:
            if not gemm_select.offered(kind, bucket_of(rows)):
                return None
            if kind in makers and kind not in made:
                made[kind] = makers[kind]()
            x = torch.randn(rows, h, **p)
            if kind == "onednn":
                return lambda: onednn_linear(x, made[kind], None)
            if kind in ("gemv", "panel"):
                return lambda: made[kind](x)
            return lambda: dense.apply(x)
        return make

    factories["head"] = {k: head_run(k) for k in factories["qkv"]}
    return factories


def measure_gemms(config: Any, dtype: torch.dtype, scratch: Callable[[], Any],
                  remeasure: bool = False) -> GemmPlan:
    """Time the candidates on a scratch DecoderLayer of the model's shapes (`scratch()`:
    dense, random weights) and a random LM head (or read the cache: nothing is built then).
    With MLA or routed experts oneDNN for every projection and the LM head where it packs
    (dense where it does not), as before the per-bucket choice (which times DecoderLayer's
    projections, not MLA's or MoE's)."""
    if config.mla is not None or config.moe is not None:
        packs = onednn_available(dtype, torch.device("cpu"))
        return gemm_select.forced_plan("onednn" if packs else "dense")
    c = config
    h = c.hidden_size
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, h), "o": (h, c.q_size),
              "mlp": (2 * c.intermediate_size, h), "down": (h, c.intermediate_size),
              "head": (c.vocab_size, h)}

    def factories(layer_ops: bool = True) -> dict:
        head = torch.randn(c.vocab_size, h, dtype=dtype).mul_(0.02)
        return gemm_candidates(scratch(), head, layer_ops)

    plan = gemm_select.model_plan(factories, shapes, c.num_hidden_layers,
                                  torch.empty(0, dtype=dtype).element_size(),
                                  str(dtype).split(".")[-1], remeasure)
    if plan.source != "forced":
        logger.info("GEMM kernels (%s; %s, %s, %d threads; row buckets %s): %s",
                    plan.source, cpu_info().model_name, str(dtype).split(".")[-1],
                    torch.get_num_threads(), "/".join(gemm_select.BUCKET_LABELS),
                    plan.describe())
    return plan


def gemm_plan(config: Any, dtype: torch.dtype, kernel: str, scratch: Callable[[], Any],
              remeasure: bool = False) -> GemmPlan | None:
    """The GEMM plan of a float model on the CPU: kernel "auto" measures in float32 (or reads
    the cached measurement for this CPU and shapes) and packs everything in other dtypes,
    "onednn" packs everything, "dense" packs nothing (None: F.linear everywhere), "gemv" runs
    the C++ GEMV in the first row bucket and dense elsewhere, "panel" the panel GEMM above
    the first bucket (panel_gemm.py, float32). On a build or dtype oneDNN cannot pack,
    "onednn" stays dense (and "auto" chooses between dense and the C++ kernels); without a
    compiler "gemv" and "panel" stay dense. With tied embeddings a oneDNN or panel LM head
    needs a packed copy of the embedding table (vocab_size x hidden_size more memory, each).
    `remeasure`: "auto" measures again rather than reading the cache (gemm_select.choose)."""
    if kernel not in ("auto", *gemm_select.KERNELS):
        raise ValueError(f"GEMM kernel must be 'auto' or one of {gemm_select.KERNELS}, "
                         f"got {kernel!r}")
    cpu = torch.device("cpu")
    onednn = onednn_available(dtype, cpu)
    has_gemv = gemv_available(dtype, cpu)
    has_panel = panel_gemm.available(dtype, cpu)
    if (kernel == "onednn" and not onednn) or (kernel == "gemv" and not has_gemv) or \
            (kernel == "panel" and not has_panel):
        kernel = "dense"
    elif kernel == "auto" and dtype != torch.float32:
        # F.linear in bf16/fp16 is itself an unpacked oneDNN call, compiled per row count
        # (unbounded kernel cache, docs/soak.md): packed oneDNN is both faster and bounded.
        kernel = "onednn" if onednn else "dense"
    elif kernel == "auto" and not (onednn or has_gemv or has_panel):
        kernel = "dense"  # nothing to choose between
    plan = gemm_select.forced_plan(kernel) if kernel != "auto" \
        else measure_gemms(config, dtype, scratch, remeasure)
    return check_plan(plan, dtype)


def check_plan(plan: GemmPlan, dtype: torch.dtype) -> GemmPlan:
    """`plan`, after checking that this machine runs each of its kernels in `dtype`."""
    cpu = torch.device("cpu")
    for kernel, ok, what in (("onednn", onednn_available, "oneDNN cannot pack"),
                             ("gemv", gemv_available, "the C++ GEMV kernel cannot run"),
                             ("panel", panel_gemm.available, "the panel GEMM kernel cannot run")):
        if any(plan.uses(p, kernel) for p in (*_PROJS, "head")) and not ok(dtype, cpu):
            raise ValueError(f"{what} {dtype} weights on this machine")
    return plan


def plan_for(config: Any, dtype: torch.dtype, device: torch.device, *, gemm: str | None = "auto",
             remeasure: bool = False, quantization: str = "none",
             tp: TensorParallel | None = None, elementwise: str = "torch",
             scratch: Callable[[], Any] | None = None,
             gemm_plan_override: GemmPlan | None = None) -> ExecutionPlan:
    """The plan a model of `config` is built with. On the CPU: a quantized model's methods
    (`quantization` "gguf" or an at-load format: no GEMM plan, the blocks' kernels), or the
    GEMM plan `gemm` names (None: F.linear; `gemm_plan_override`: this plan, checked); a
    tensor-parallel rank measures its own shapes and keeps o, down and the head dense, for
    the all-reduces to wrap (DeepSeek's ranks stay dense). On the GPU the dense methods, with
    the Triton norm, RoPE and SiLU-and-mul where `elementwise` is "triton" (each PyTorch
    element-wise op is a kernel launch there)."""
    if device.type != "cpu":
        if elementwise == "triton":
            from kvserve.kernels.gpu import ops as gpu_ops  # Triton: imported only here

            source = MethodSource(gpu_ops.rms_norm, gpu_ops.apply_rope, gpu_ops.silu_mul)
            return ExecutionPlan(device, dtype, source, tp)
        return ExecutionPlan(device, dtype, MethodSource(), tp)
    if quantization != "none":
        return ExecutionPlan(device, dtype, CpuMethods(dtype, None, quantization,
                                                       config.num_hidden_layers), tp)
    if tp is not None and (config.mla is not None or config.moe is not None
                           or dtype != torch.float32):
        return ExecutionPlan(device, dtype, MethodSource(), tp)
    plan = gemm_plan_override
    if plan is None and gemm is not None:
        plan = gemm_plan(config, dtype, gemm, scratch, remeasure)
    if plan is None:
        return ExecutionPlan(device, dtype, MethodSource(), tp)
    if tp is not None:  # o, down and the head stay dense: Reduced and GatheredHead wrap them
        kernels = {p: list(ks) for p, ks in plan.kernels.items()}
        for p in ("o", "down", "head"):
            kernels[p] = ["dense"] * len(kernels[p])
        plan = replace(plan, kernels=kernels)
    if config.mla is not None or config.moe is not None:
        mla_kernel(plan)  # one kernel everywhere, or a ValueError that says so
    return ExecutionPlan(device, dtype, CpuMethods(dtype, check_plan(plan, dtype)), tp)


def resolve_dtype(dtype: str | torch.dtype, config: Any,
                  device: str | torch.device = "cpu") -> torch.dtype:
    """"auto" takes config.json's dtype (float32 when absent), except that on a CPU without
    bf16 instructions (AVX512_BF16 or AMX) a bf16/fp16 checkpoint runs in float32: there half
    precision is emulated, many times slower, not faster. An explicit "bfloat16" on such a
    CPU is honoured with a warning that says what it costs (`half_precision_cost`)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in [to_torch_dtype(name) for name in DTYPES]:
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        chosen, auto = dtype, False
    else:
        name = (config.torch_dtype or "float32") if dtype == "auto" else canonical_dtype(dtype)
        if name is None:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        chosen, auto = to_torch_dtype(name), dtype == "auto"
    if torch.device(device).type != "cpu" or chosen == torch.float32 or cpu_info().has_bf16:
        return chosen
    if auto:
        logger.info("dtype auto: this CPU has no bf16 instructions (AVX512_BF16/AMX), so the "
                    "%s checkpoint runs in float32", str(chosen).split(".")[-1])
        return torch.float32
    logger.warning("dtype=%s on a CPU without bf16 instructions (%s): a GEMM takes %.1fx as long "
                   "as in float32 here (measured); dtype='float32' or 'auto' is faster",
                   str(chosen).split(".")[-1], cpu_info().summary(), half_precision_cost(chosen))
    return chosen


def half_precision_cost(dtype: torch.dtype, n: int = 256) -> float:
    """How many times longer an n x n x n matmul takes in `dtype` than in float32 on this CPU
    (best of 3; small enough to finish fast where the half-precision path is emulated)."""
    def best(dt: torch.dtype) -> float:
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        torch.mm(a, b)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(dtype) / max(best(torch.float32), 1e-9)


def keeps_gguf_blocks(quantization: str | None, dtype: torch.dtype, device: torch.device,
                      default: str = "gguf") -> bool:
    """Whether a GGUF file's block formats stay quantized: `quantization` "gguf" (float32 on
    the CPU only, else a ValueError), or None (`default`, where the kernels run: float32 on
    the CPU); and the quantized kernels build here (else a warning: dequantized at load)."""
    if quantization is None:  # the default: where the kernels run, else as before
        if default == "none" or device.type != "cpu" or dtype != torch.float32:
            return False
    elif quantization == "none":
        return False
    elif device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization='gguf' runs on the CPU in float32 only (the quantized "
                         f"kernels are C++ CPU kernels), not {device.type} {dtype}; use "
                         "quantization='none' to dequantize the weights at load")
    if qgemv.load() is None:
        logger.warning("quantization: the quantized kernels cannot be built here; the GGUF "
                       "weights are dequantized at load")
        return False
    return True


def warm_up_gemms(model: Any, max_rows: int, max_logit_rows: int,
                  max_flops: float = 2e11) -> int:
    """`warm_up_steps` run to the end: how many row counts it warmed."""
    return sum(1 for _ in warm_up_steps(model, max_rows, max_logit_rows, max_flops))


def warm_up_steps(model: Any, max_rows: int, max_logit_rows: int,
                  max_flops: float = 2e11) -> Iterator[int]:
    """Run each oneDNN GEMM once at every row count `gemm_rows` yields for 1..max_rows (the
    LM head up to max_logit_rows) in the buckets the GEMM plan runs through oneDNN,
    smallest first, while the FLOPs spent stay under `max_flops`, yielding each row count
    once it is warmed (nothing without packed weights; a server runs them while it has no
    request: AsyncLLMEngine.run_when_idle).

    Why: oneDNN compiles a kernel the first time it meets a shape and keeps it for the life
    of the process (about 0.7 MB each on this project's CPU). Compiling them all up front
    makes a server reach its steady memory at start-up, instead of creeping up for hours
    as rare batch sizes turn up, and no request waits on a compile. Layers with the same
    shapes share kernels, so one layer of each shape (`warm_up_layers`) is enough. (The
    dense kernels, MKL, compile nothing.)"""
    if not model.packed or not model.layers:
        return
    c = model.config
    h = c.hidden_size
    kernels = model.gemm_plan.kernels
    layers = model.warm_up_layers()
    per_row = sum(layer.gemm_flops_per_row() for layer in layers)
    zeros = dict(dtype=model.dtype, device=model.device)
    spent = 0.0
    for rows in sorted({gemm_rows(t) for t in range(1, max_rows + 1)}):
        b = bucket_of(rows)
        head = rows <= max_logit_rows and kernels["head"][b] == "onednn"
        body = any(kernels[p][b] == "onednn" for p in _PROJS)
        if not (head or body):
            continue
        cost = rows * ((per_row if body else 0) + (2 * h * c.vocab_size if head else 0))
        if spent + cost > max_flops:
            break
        with torch.inference_mode():  # not held across a yield (it is per thread)
            x = torch.zeros(rows, h, **zeros)
            if body:
                for layer in layers:
                    layer.warm_up_gemms(x, b)
            if head:
                model.compute_logits(x)
        spent += cost
        yield rows


