"""Build the model a worker runs: read its config, decide how it computes (the
`ExecutionPlan`: dtype, the measured CPU GEMM plan, quantized weights, a tensor-parallel
rank's part), then let the loader build it with that plan and fill it.

Why here and not in the loader: choosing kernels measures this machine and knows the
platform, while the loader only reads files and copies (it imports no kernel); vLLM's worker
likewise builds its configs before its model loader runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.utils import features as F
from kvserve.utils import quant_formats
from kvserve.utils.dtypes import canonical_dtype
from kvserve.layers import selection
from kvserve.layers.kernel_choice import integer_rows, override
from kvserve.layers.plan import ExecutionPlan, TensorParallel
from kvserve.model_loader import loader
from kvserve.models.config import ModelConfig
from kvserve.models.decoder import CausalLM

if TYPE_CHECKING:
    from kvserve.layers.gemm_select import GemmPlan
    from kvserve.model_loader.tp_layout import RankLayout

QUANTIZATIONS = quant_formats.QUANTIZATIONS


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu",
               pack_weights: bool = True, gemm: str | None = None,
               remeasure_kernels: bool = False,
               quantization: str | None = None,
               shard: "RankLayout | None" = None, tp: TensorParallel | None = None,
               elementwise: str = "torch", gemm_plan: "GemmPlan | None" = None,
               deterministic: bool = False) -> tuple[CausalLM, ModelConfig]:
    """Read config.json and the safetensors weights of `model_dir`, or a GGUF file (its tensors
    dequantized into the model dtype, or kept as blocks); raises ValueError on any problem
    with the checkpoint, naming the file or tensor at fault.

    With `pack_weights` (the default) each projection gets the GEMM kernel that measures
    fastest on this CPU per batch size (`selection.gemm_plan`; `gemm` = "auto", "onednn",
    "dense", "gemv" or "panel", default $KVSERVE_KERNEL's gemm= or "auto"); the logits are the same up
    to float rounding either way; `remeasure_kernels` measures them again rather than reading
    the choice cached for this CPU and model shape. Without it every GEMM stays dense
    (F.linear).

    `quantization` (vLLM's name): "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/
    Q6_K projections and embedding table in their block format, run by the quantized kernels
    (kvserve/layers/quant_linear.py; float32 on the CPU only, where the kernels build);
    "none" dequantizes every tensor at load; None is DEFAULT_QUANTIZATION for a GGUF file on
    the CPU, else "none". "q8_0", "q4_0", "q4_1" and "q4_k" quantize a float checkpoint's
    projections at load into those block formats (quantize_at_load.py; float32 on the CPU:
    dtype "auto" means float32 there).

    `shard` (a tensor-parallel rank's layout, kvserve/model_loader/tp_layout.py) with `tp`
    (its communicator and vocabulary split) builds that rank's part of the model and reads
    only its slice of each tensor; a GGUF file is dequantized. `elementwise` "triton": the
    GPU's fused norm, RoPE and SiLU-and-mul. `gemm_plan`: run this GEMM plan (checked), not
    a measured one. `deterministic`: quantized projections run the integer kernel at every
    row count (kernel_choice.integer_rows). The config returned is the whole model's."""
    with integer_rows(deterministic):
        return _load_model(model_dir, dtype, device, pack_weights, gemm, remeasure_kernels,
                           quantization, shard, tp, elementwise, gemm_plan)


def _load_model(model_dir: str | Path, dtype: str | torch.dtype, device: str | torch.device,
                pack_weights: bool, gemm: str | None, remeasure_kernels: bool,
                quantization: str | None, shard: "RankLayout | None",
                tp: TensorParallel | None, elementwise: str, gemm_plan: "GemmPlan | None"
                ) -> tuple[CausalLM, ModelConfig]:
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None, the default), "
                         f"got {quantization!r}")
    config, gguf = loader.read_config(model_dir)
    at_load = quantization in quant_formats.AT_LOAD
    if at_load:
        dtype, device = _at_load_dtype(quantization, dtype, device, gguf is not None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    torch_dtype = selection.resolve_dtype(dtype, config, device)
    model_config = config
    if shard is not None:
        from kvserve.model_loader.tp_layout import rank_config

        if at_load:
            F.refuse(F.TENSOR_PARALLEL, F.QUANTIZE_AT_LOAD)
        model_config, quantization = rank_config(config, shard), "none"
    if at_load:
        from kvserve.layers.quantize_at_load import check_quantizable

        check_quantizable(config, quantization)
        kind = quantization
    elif gguf is not None and selection.keeps_gguf_blocks(
            quantization, torch_dtype, device, loader.DEFAULT_QUANTIZATION):
        kind = "gguf"
    else:
        kind = "none"
    kernel = None
    if pack_weights or shard is not None:
        kernel = gemm or override().gemm or "auto"
    plan = selection.plan_for(model_config, torch_dtype, device, gemm=kernel,
                              remeasure=remeasure_kernels, quantization=kind, tp=tp,
                              elementwise=elementwise, gemm_plan_override=gemm_plan,
                              scratch=lambda: scratch_layer(model_config, torch_dtype))
    model = loader.load_checkpoint(model_dir, plan, model_config, config, gguf, shard)
    return model, config


def scratch_layer(config: ModelConfig, dtype: torch.dtype) -> Any:
    """A dense DecoderLayer of `config`'s shapes with random weights (norms 1), on the CPU:
    what the GEMM plan is measured on before the model exists."""
    from kvserve.models.decoder import DecoderLayer

    layer = DecoderLayer(config, 0, ExecutionPlan.dense(dtype, "cpu"))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    layer.process_weights_after_loading()
    return layer


def _at_load_dtype(quantization: str, dtype: str | torch.dtype,
                   device: str | torch.device, is_gguf_file: bool) -> tuple:
    """(dtype, device) of a quantize-at-load model: float32 ("auto" included) on the CPU
    ("auto" included)."""
    if is_gguf_file:
        raise ValueError(f"quantization={quantization!r} quantizes a float safetensors "
                         "checkpoint; a GGUF file's own block formats run with "
                         "quantization='gguf' (or None)")
    dtype = "float32" if dtype == "auto" else dtype
    device = "cpu" if device == "auto" else device
    f32 = dtype == torch.float32 if isinstance(dtype, torch.dtype) \
        else canonical_dtype(dtype) == "float32"
    if torch.device(device).type != "cpu" or not f32:
        raise ValueError(f"quantization={quantization!r} runs on the CPU in float32 only (the "
                         f"quantized kernels are C++ CPU kernels), not {device} {dtype}")
    return dtype, device
