"""Binds kernels onto a model's layers as methods: the measured GEMM plan on the CPU
(`pack_weights`, `apply_gemm_plan`), the fused Triton element-wise kernels on the GPU
(`use_triton_ops`), and the warm-up of oneDNN's shapes (`warm_up_steps`).

The model code (kvserve/models/decoder.py, deepseek.py, kvserve/models/) never imports this
module or kvserve.kernels (tests/test_architecture.py): a DecoderLayer holds one
`LayerMethods` per row bucket and runs whichever it is given, the LM head one `LinearMethod`
per bucket, and the model a `decode_step` (the one-call C++ decode, `FastDecode`) where the
plan allows it. The candidates the plan is measured on are made here too
(`gemm_candidates`), from the same ops the plan binds.

On the CPU `pack_weights` (called by the loader) gives each projection and the LM head the
GEMM kernel that measures fastest on this CPU for each row bucket (gemm_select.py):
`F.linear` (MKL in float32), oneDNN on weights packed in its blocked layout with the gate's
SiLU (or GELU-tanh), the gated product and the residual add as fused epilogues, the panel
GEMM or the GEMV (kernels/cpu/). Which wins depends on the CPU and the batch: on a Zen 5
oneDNN was ~2x faster at every size; on an AVX-512 Xeon MKL wins at batch 1; on an AVX2 EPYC
oneDNN loses at batch 1 and wins at batch 64 for some shapes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from kvserve.kernels.cpu import gemv, panel_gemm, qgemv
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.layers import gemm_select
from kvserve.layers.block import PROJECTIONS as _PROJS
from kvserve.layers.block import LayerMethods, dense_methods
from kvserve.layers.buckets import BUCKETS, bucket_of
from kvserve.layers.cpu_layer_ops import kernel_ops, wrap_unfused
from kvserve.layers.cpu_linear import (Gemv, OneDNN, Panel, gemm_rows, gemv_available,
                                       onednn_available, onednn_linear, onednn_pack)
from kvserve.layers.fast_decode import FastDecode
from kvserve.layers.gemm_select import GemmPlan
from kvserve.layers.linear import Dense, DenseGated
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope
from kvserve.layers.quant_decode import QuantDecode, cpp_rope
from kvserve.layers.quant_linear import (PROJECTION_ATTRS, QuantizedEmbedding, QuantizedLinear,
                                        quantized_methods)
from kvserve.models.decoder import CausalLM, DecoderLayer
from kvserve.models.deepseek_layers import DeepseekLayer, MoE, SwiGLU

logger = logging.getLogger("kvserve")

MLP_CHUNK_BYTES = 16 << 20  # gate/up activations of one chunk of a long prefill's MLP
MLP_CHUNK_MIN_ROWS = 256


def mlp_chunk_rows(intermediate_size: int, element_size: int) -> int:
    """Rows per chunk of a long prefill's MLP on the CPU: the gate/up activations ([rows,
    2 x intermediate]) of one chunk stay near MLP_CHUNK_BYTES, at least MLP_CHUNK_MIN_ROWS
    rows (the GEMMs' efficiency), a multiple of 64.

    Why: the MLP of a whole 8,192-token step wrote and re-read 92 MB of gate/up activations
    (the reference model) that no cache held. Measured per row, 2 threads: MKL + SwiGLU
    ~9.6 us at 1,000-2,000 rows, 12.5 at 3,000, 14.3 at 8,192 (oneDNN 9.9 -> 13.0); the
    rows are independent, so chunks change no result."""
    rows = MLP_CHUNK_BYTES // max(1, 2 * intermediate_size * element_size)
    return max(MLP_CHUNK_MIN_ROWS, rows // 64 * 64)


# -- a DecoderLayer's kernels per row bucket ------------------------------------------------
def layer_candidates(layer: DecoderLayer, layer_ops: bool = True
                     ) -> dict[str, dict[str, gemm_select.RunFactory]]:
    """For each projection and kernel, a factory(rows) -> run-once callable on `layer`'s own
    weights (packed copies made here and dropped after): what `gemm_select` times. Call
    before `bind_layer`, while the dense weights are all there.

    layer_ops: time each kernel's projection as the layer runs it (qkv with the input norm
    and RoPE around it, gate/up with the post-attention norm): the GEMV and the panel GEMM
    norm in their own calls, the other kernels run the norms as separate ops, and the
    choice should see that. False: the GEMMs alone (the benchmarks' GEMM ceiling). Each
    kernel's ops (and packed copies) are made when a factory of it is first called."""
    p = {"dtype": layer.qkv_proj.dtype, "device": layer.qkv_proj.device}
    kernels = ["dense"]
    if onednn_available(**p):
        kernels.append("onednn")
    if gemv_available(**p):
        kernels.append("gemv")
    if panel_gemm.available(**p):
        kernels.append("panel")
    built: dict[str, dict[str, Callable]] = {}
    h, q = layer.qkv_proj.shape[1], layer.q_size

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


def bind_layer(layer: DecoderLayer, plan: GemmPlan
               ) -> tuple[gemv.BoundGemv, gemv.BoundMLPBlock] | None:
    """Bind one `LayerMethods` per row bucket onto `layer` as `plan` says: pack (oneDNN,
    panel) the weights some bucket runs through a packed kernel, free the dense ones no
    bucket uses. Returns the layer as bound C++ ops (the qkv GEMV with its norm and RoPE, the
    MLP block) where the first bucket runs everything on the GEMV, for FastDecode; else None.

    Gate and up are packed apart for oneDNN (`OneDNNGated`): SiLU then runs as the gate GEMM's
    epilogue and the product as the up GEMM's."""
    built = {k: kernel_ops(layer, k, tuple(p for p in _PROJS if plan.uses(p, k)), fused=True)
             for k in gemm_select.KERNELS}
    for kernel, ops in built.items():
        wrap_unfused(layer, kernel, ops)
    methods = []
    layer.mlp_chunk_rows = mlp_chunk_rows(layer.intermediate_size, layer.o_proj.element_size())
    block = None
    fast_ops = None
    for b in range(len(BUCKETS)):
        ops = {p: built[plan.kernels[p][b]][p] for p in _PROJS}
        fused = None
        if all(plan.kernels[p][b] == "gemv" for p in ("o", "mlp", "down")) \
                and layer.attn_out_norm is None and layer.mlp_out_norm is None \
                and layer.post_attention_layernorm is not None:
            block = block or gemv.load().bind_mlp_block(
                layer.o_proj, layer.o_bias, layer.post_attention_layernorm, layer.eps,
                layer.gate_up_proj, layer.gate_up_bias, layer.down_proj, layer.down_bias,
                layer.gelu)
            fused = block
        methods.append(LayerMethods(ops["qkv"], ops["o"], ops["mlp"], ops["down"], fused))
        if b == 0 and fused is not None and plan.kernels["qkv"][0] == "gemv" \
                and layer.qk_norm is None and layer.input_layernorm is not None:
            # the whole layer as bound C++ ops, for FastDecode
            fast_ops = (gemv.load().bind(
                layer.qkv_proj, layer.qkv_bias, norm_weight=layer.input_layernorm,
                eps=layer.eps, rope_cols=layer.qk_size, head_dim=layer.head_dim), fused)
    layer.methods = methods
    # free the dense weights no bucket reads (the methods hold what they need)
    for proj, name in (("qkv", "qkv_proj"), ("o", "o_proj"), ("mlp", "gate_up_proj"),
                       ("down", "down_proj")):
        if not any(plan.uses(proj, k) for k in gemm_select.ROW_MAJOR):
            setattr(layer, name, None)
    return fast_ops


# -- DeepSeek's layers (MLA, MoE): one kernel for every bucket ------------------------------
def bind_mla_layer(layer: DeepseekLayer, plan: GemmPlan) -> None:
    """Bind `plan`'s kernel: these layers have one set of ops for every row bucket (the
    per-bucket choice of gemm_select.py is measured on DecoderLayer's projections), so a
    plan must give every projection and bucket the same kernel (the LM head may differ)."""
    # the C++ GEMV and panel GEMM are not wired into MLA / MoE: those projections stay dense
    kernels = {"dense" if k in ("gemv", "panel") else k for p in _PROJS
               for k in plan.kernels[p]}
    if len(kernels) != 1:
        raise ValueError("DeepSeek layers run one GEMM kernel for every projection and "
                         f"batch size; the plan mixes {sorted(kernels)}")
    if kernels == {"onednn"}:
        pack_mla_layer(layer)


def pack_mla_layer(layer: DeepseekLayer) -> None:
    """oneDNN-packed q/kv down-projections, q up-projection, o_proj and dense MLPs (rows
    rounded by gemm_rows: a bounded set of kernels); kv_b_proj stays dense (the backend slices
    it per head for absorption), and so do the routed experts."""
    for name in ("qkv_a_proj", "q_b_proj", "o_proj"):
        w = getattr(layer, name)
        if w is not None:
            setattr(layer, name, nn.Parameter(onednn_pack(w), requires_grad=False))
    layer.qkv_a = OneDNN(layer.qkv_a_proj)
    layer.q_b = None if layer.q_b_proj is None else OneDNN(layer.q_b_proj)
    layer.o = OneDNN(layer.o_proj)
    mlp = layer.mlp.shared if isinstance(layer.mlp, MoE) else layer.mlp
    if isinstance(mlp, SwiGLU):
        mlp.gate_up_proj = nn.Parameter(onednn_pack(mlp.gate_up_proj), requires_grad=False)
        mlp.down_proj = nn.Parameter(onednn_pack(mlp.down_proj), requires_grad=False)
        mlp.gate_up, mlp.down = OneDNN(mlp.gate_up_proj), OneDNN(mlp.down_proj)


# -- the model ------------------------------------------------------------------------------
def pack_weights(model: CausalLM, kernel: str = "auto", remeasure: bool = False) -> bool:
    """Choose the GEMM kernel of every projection and the LM head per row bucket and re-lay
    the weights out for it (gemm_select.py); returns whether any weight now runs through
    oneDNN. Call once, after the weights are loaded: packed weights can no longer be sliced
    or copied into.

    kernel: "auto" measures in float32 (or reads the cached measurement for this CPU and
    shapes) and packs everything in other dtypes, "onednn" packs everything, "dense" packs
    nothing, "gemv" runs the C++ GEMV in the first row bucket and dense elsewhere, "panel"
    the panel GEMM above the first bucket (panel_gemm.py, float32). On a build or dtype
    oneDNN cannot pack, "onednn" stays dense (and "auto" chooses between dense and the C++
    kernels); without a compiler "gemv" and "panel" stay dense. With tied embeddings a oneDNN
    or panel LM head needs a packed copy of the embedding table (vocab_size x hidden_size
    more memory, each). `remeasure`: "auto" measures again rather than reading the cache
    (gemm_select.choose)."""
    if model.gemm_plan is not None:
        return model.packed
    if kernel not in ("auto", *gemm_select.KERNELS):
        raise ValueError(f"GEMM kernel must be 'auto' or one of {gemm_select.KERNELS}, "
                         f"got {kernel!r}")
    device = model.embed_tokens.device
    if device.type != "cpu" or not model.layers:
        return False
    onednn = onednn_available(model.dtype, device)
    has_gemv = gemv_available(model.dtype, device)
    has_panel = panel_gemm.available(model.dtype, device)
    if (kernel == "onednn" and not onednn) or (kernel == "gemv" and not has_gemv) or \
            (kernel == "panel" and not has_panel):
        kernel = "dense"
    elif kernel == "auto" and model.dtype != torch.float32:
        # F.linear in bf16/fp16 is itself an unpacked oneDNN call, compiled per row count
        # (unbounded kernel cache, docs/soak.md): packed oneDNN is both faster and bounded.
        kernel = "onednn" if onednn else "dense"
    elif kernel == "auto" and not (onednn or has_gemv or has_panel):
        kernel = "dense"  # nothing to choose between
    plan = gemm_select.forced_plan(kernel) if kernel != "auto" \
        else measure_gemms(model, remeasure)
    return apply_gemm_plan(model, plan)


def apply_gemm_plan(model: CausalLM, plan: GemmPlan) -> bool:
    """Re-lay the weights out as `plan` says and bind its kernels (see pack_weights)."""
    device = model.embed_tokens.device
    if any(plan.uses(p, "onednn") for p in (*_PROJS, "head")) and \
            not onednn_available(model.dtype, device):
        raise ValueError(f"oneDNN cannot pack {model.dtype} weights on this machine")
    if any(plan.uses(p, "gemv") for p in (*_PROJS, "head")) and \
            not gemv_available(model.dtype, device):
        raise ValueError(f"the C++ GEMV kernel cannot run {model.dtype} weights here")
    if any(plan.uses(p, "panel") for p in (*_PROJS, "head")) and \
            not panel_gemm.available(model.dtype, device):
        raise ValueError(f"the panel GEMM kernel cannot run {model.dtype} weights here")
    fast_ops = [bind_layer(layer, plan) if isinstance(layer, DecoderLayer)
                else bind_mla_layer(layer, plan) for layer in model.layers]
    head_dense = model.lm_head if model.lm_head is not None else model.embed_tokens
    head_packed = onednn_pack(head_dense) if plan.uses("head", "onednn") else None
    if model.lm_head is not None and \
            not any(plan.uses("head", k) for k in gemm_select.ROW_MAJOR):
        model.lm_head = None  # the packed copy is the head now
    head_gemv = Gemv(gemv.load().bind(head_dense)) if plan.uses("head", "gemv") else None
    head_panel = Panel(panel_gemm.load().bind(panel_gemm.load().pack(head_dense))) \
        if plan.uses("head", "panel") else None
    by_kernel = {"onednn": OneDNN(head_packed) if head_packed is not None else None,
                 "dense": Dense(head_dense), "gemv": head_gemv, "panel": head_panel}
    model.head_methods = [by_kernel[k] for k in plan.kernels["head"]]
    if gemv_available(model.dtype, device):
        model.norm_fn = gemv.load().rms_norm  # the final norm too (see attn_in_unfused)
    model.decode_step = None
    if all(op is not None for op in fast_ops) and len(set(model._rope_of_layer)) == 1:
        c = model.config
        model.decode_step = FastDecode(fast_ops, c.num_attention_heads, c.num_key_value_heads,
                                       model.layers[0].head_dim)
    model.gemm_plan = plan
    model.packed = any("onednn" in ks for ks in plan.kernels.values())
    if plan.source != "forced":
        logger.info("GEMM kernels (%s; %s, %s, %d threads; row buckets %s): %s",
                    plan.source, cpu_info().model_name, str(model.dtype).split(".")[-1],
                    torch.get_num_threads(), "/".join(gemm_select.BUCKET_LABELS),
                    plan.describe())
    return model.packed


def gemm_candidates(model: CausalLM, layer_ops: bool = True
                    ) -> dict[str, dict[str, gemm_select.RunFactory]]:
    """projection -> kernel -> factory(rows) -> run-once callable, on layer 0's weights and
    the LM head (oneDNN-packed copies made here): what `gemm_select` times, and what
    benchmarks time for the machine's GEMM ceiling (`layer_ops`: see layer_candidates).
    Needs the dense weights (before `pack_weights`, or with kernel "dense")."""
    h = model.config.hidden_size
    factories = layer_candidates(model.layers[0], layer_ops)
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    # made at a factory's first call; the C++ ones bound once, as apply_gemm_plan binds
    # them (the checked call costs ~10 us more)
    makers = {"onednn": lambda: onednn_pack(head), "gemv": lambda: gemv.load().bind(head),
              "panel": lambda: panel_gemm.load().bind(panel_gemm.load().pack(head))}
    made: dict[str, Callable] = {}
    p = {"dtype": model.dtype, "device": head.device}
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


def measure_gemms(model: CausalLM, remeasure: bool = False) -> GemmPlan:
    """Time the candidates on layer 0's weights and the LM head (or read the cache). On
    DeepSeek's layers oneDNN for every projection and the LM head, as before the per-bucket
    choice (which times DecoderLayer's projections, not MLA's or MoE's)."""
    if not isinstance(model.layers[0], DecoderLayer):
        return gemm_select.forced_plan("onednn")
    c = model.config
    h = c.hidden_size
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, h), "o": (h, c.q_size),
              "mlp": (2 * c.intermediate_size, h), "down": (h, c.intermediate_size),
              "head": (c.vocab_size, h)}
    return gemm_select.model_plan(lambda layer_ops=True: gemm_candidates(model, layer_ops),
                                  shapes, c.num_hidden_layers,
                                  model.embed_tokens.element_size(),
                                  str(model.dtype).split(".")[-1], remeasure)


def warm_up_gemms(model: CausalLM, max_rows: int, max_logit_rows: int,
                  max_flops: float = 2e11) -> int:
    """`warm_up_steps` run to the end: how many row counts it warmed."""
    return sum(1 for _ in warm_up_steps(model, max_rows, max_logit_rows, max_flops))


def warm_up_steps(model: CausalLM, max_rows: int, max_logit_rows: int,
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
    zeros = dict(dtype=model.dtype, device=model.embed_tokens.device)
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


# -- quantized weights (issue 31) -----------------------------------------------------------
def bind_quantized(model: CausalLM) -> None:
    """Bind the quantized linear methods (kvserve/layers/quant_linear.py) onto the layers
    whose projections the loader kept in their GGUF block format (`layer.quant_weights`; a
    projection it kept in float runs F.linear). At the first row bucket the LM head runs its
    Q8_0 table (`model.quant_head`, where the file has one) with x kept in float32 (the
    float table, else the GEMV, above it): the integer kernel there, x quantized to 8 bits,
    changed the demo's answer ("What is the capital of France?" no longer began "The capital
    of France is Paris"), the final norm's outliers setting each block's scale. Where the
    loader kept the embedding table quantized (`model.quant_embed`), lookups read its
    blocks and a tied head runs them at every bucket (no float table is left): x in float32
    on Q8_0, the integer kernel on the other types (no float-x path for them yet; a
    projection-sized error, bounded by tests/test_quant_kquants.py). Installs a plan of
    source "quantized" in place of the measured one: the GEMM plan times float kernels, which
    these layers no longer have weights for. The one-call decode step is QuantDecode's (where
    every projection is blocks; FastDecode reads float weights)."""
    has_gemv = gemv_available(model.dtype, model.embed_tokens.device)
    for layer in model.layers:
        quant = getattr(layer, "quant_weights", None)
        if not quant:
            continue
        norm = gemv.load().rms_norm if has_gemv and layer.qk_norm is None else rms_norm
        weights = {a: quant.get(a, getattr(layer, a)) for a in PROJECTION_ATTRS}
        rope = cpp_rope if has_gemv else apply_rope
        layer.methods = [quantized_methods(layer, weights, norm, rope)] * len(BUCKETS)
        layer.mlp_chunk_rows = mlp_chunk_rows(layer.intermediate_size, 4)
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    model.head_methods = [Dense(head)] * len(BUCKETS)
    head_kernels = ["dense"] * len(BUCKETS)
    quant_head = getattr(model, "quant_head", None)
    quant_embed = getattr(model, "quant_embed", None)
    if quant_embed is not None:  # the table kept quantized: lookups read the blocks
        model.embed_fn = QuantizedEmbedding(quant_embed)
    if quant_head is not None and quant_embed is not None and model.lm_head is None:
        # tied and no float table at all: the head runs the table's blocks at every bucket
        # (x in float32 on Q8_0; the integer kernel on the others, no float path for them)
        fx = quant_head.type_name == "Q8_0"
        model.head_methods = [QuantizedLinear(quant_head, None, float("inf"),
                                              float_x=fx)] * len(BUCKETS)
        head_kernels = ["quant-fx" if fx else "quant"] * len(BUCKETS)
    elif quant_head is not None:  # Q8_0, x in float: 0.9 ms at batch 1 against fp32's 2.2
        model.head_methods[0] = QuantizedLinear(quant_head, None, float("inf"), float_x=True)
        head_kernels[0] = "quant-fx"
    elif has_gemv:  # the float GEMV at a few rows, as a measured plan has it on most CPUs
        model.head_methods[0] = Gemv(gemv.load().bind(head))
        head_kernels[0] = "gemv"
    if has_gemv:
        model.norm_fn = gemv.load().rms_norm
    # the one-call step where every layer's projections are blocks (its norm and RoPE are the
    # C++ ones the layers bind above, so only with the GEMV's library)
    model.decode_step = QuantDecode.build(model) if has_gemv else None
    model.gemm_plan = GemmPlan({**{p: ["quant"] * len(BUCKETS) for p in _PROJS},
                                "head": head_kernels}, "quantized")
    model.packed = False
    logger.info("quantized projections (%s kernel): %s", qgemv.load().isa,
                model.gemm_plan.describe())


def use_triton_ops(model: CausalLM) -> None:
    """The fused Triton RMSNorm / RoPE / SiLU-and-mul (`kvserve.kernels.gpu.ops`) around
    every DecoderLayer's dense projections, and the final norm: the GPU path, where each
    PyTorch element-wise op is a kernel launch. A model with a GEMM plan (the CPU, where a
    Triton backend runs in the interpreter) keeps its plan's layer methods, as before this
    was a function: only the final norm changes. DeepSeek's layers keep the plain PyTorch
    element-wise ops (no fused MLA kernels yet)."""
    from kvserve.kernels.gpu import ops as gpu_ops  # Triton: imported only on this path

    for layer in model.layers:
        if not isinstance(layer, DecoderLayer) or model.gemm_plan is not None:
            continue
        gate_up = None
        if not layer.gelu:
            gate_up = DenseGated(layer.gate_up_proj, layer.gate_up_bias,
                                 layer.intermediate_size, layer.gelu, act=gpu_ops.silu_mul)
        layer.methods = [dense_methods(layer, gpu_ops.rms_norm, gpu_ops.apply_rope,
                                       gate_up)] * len(BUCKETS)
    model.norm_fn = gpu_ops.rms_norm
