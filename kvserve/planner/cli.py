"""`kvserve plan`: flags (vLLM's names where vLLM has one) and the command."""

from __future__ import annotations

import argparse

from kvserve.utils.cli_flags import add_report_args, print_report
from kvserve.planner import presets
from kvserve.planner.units import parse_bytes, parse_tokens
from kvserve.utils.quant_formats import QUANTIZATIONS

EPILOG = """examples:
  kvserve plan llama-2-7b --kv-cache-dtype fp16 --max-model-len 4096
  kvserve plan qwen2.5-7b --kv-cache-dtype fp8 --max-model-len 8k --gpu-memory 80GB \\
      --gpu-memory-utilization 0.92 --weight-memory 4.1GB --reserve 2GB
  kvserve plan ./my-checkpoint --gpu h100-80gb --json
  kvserve plan deepseek-v3 --tensor-parallel-size 8 --gpu h200 --plot plan.png
sizes: 80GB = 80e9 bytes, 80GiB = 80 * 2^30; token counts: 8k = 8,192."""


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a preset name (see --list-presets), a config.json, or a checkpoint "
                        "directory")
    p.add_argument("--list-presets", action="store_true", help="list the built-in models")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype), fp32, fp16, bf16, fp8 (fp8_e4m3, fp8_e5m2), "
                        "int8, int4")
    p.add_argument("--max-model-len", "--context-len", dest="context_len", default=None,
                   help="tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=16)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu-memory", default=None,
                   help="device memory per GPU, e.g. 80GB or 80GiB (default: --gpu h100-80gb)")
    g.add_argument("--gpu", choices=sorted(presets.GPUS_MIB), default=None,
                   help="a GPU by the memory CUDA reports for it")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--weight-format", default="auto",
                   help="auto, fp32, fp16, bf16, fp8, int8, awq, gptq (int4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4 quantization group size (default: the checkpoint's, else 128)")
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="the engine's weight quantization, as `kvserve serve --quantization` "
                        "(gguf keeps a GGUF file's blocks; q8_0/q4_0/q4_1/q4_k quantize a "
                        "float checkpoint at load): the weight figure is then the engine's own "
                        "count of what it will hold (float32 elsewhere); a checkpoint "
                        "directory or a GGUF file only")
    p.add_argument("--weight-memory", default=None,
                   help="weights per GPU as a size, instead of computing them (e.g. 4.1GB)")
    p.add_argument("--reserve", default="2GB",
                   help="activation peak + framework memory (default 2GB)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="the KV pool as a size, instead of computing it (vLLM's "
                        "kv_cache_memory_bytes)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="the KV pool as a number of blocks")
    p.add_argument("--kv-quant-group-size", type=int, default=None,
                   help="elements per scale group for int8/int4 KV (default: one head vector)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests running at full length, for the room left to cached prefixes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lengths", default=None,
                   help="request length distribution for fragmentation: fixed:N, uniform:A:B, "
                        "normal:MEAN:STD, lognormal:MEDIAN:SIGMA or file:PATH "
                        "(default uniform:1:CONTEXT)")
    add_report_args(p, "the plan",
                    "memory vs context length per dtype, and concurrency vs context length")


def cmd_plan(args: argparse.Namespace) -> int:
    from kvserve.planner.memory import make_plan
    from kvserve.planner.model import ModelSpec
    from kvserve.planner.report import format_plan, plot_plan

    if args.list_presets:
        for name, d in presets.PRESETS.items():
            spec = ModelSpec.from_hf_config(d, name, "preset")
            print(f"{name:<14} {spec.attention.upper():<4} {spec.num_layers:>3} layers "
                  f"{spec.num_params / 1e9:>7.2f} B params  max {spec.max_position_embeddings:,}")
        return 0
    if args.model is None:
        raise ValueError("give a model: a preset name (--list-presets), a config.json or a "
                         "checkpoint directory")
    spec = ModelSpec.load(args.model)
    weights = parse_bytes(args.weight_memory) if args.weight_memory else None
    if args.quantization is not None:
        if weights is not None:
            raise ValueError("give --quantization (the engine's count) or --weight-memory, "
                             "not both")
        from kvserve.model_loader.weight_bytes import planned_for_checkpoint

        weights = planned_for_checkpoint(args.model, args.quantization).total
    plan = make_plan(
        spec, kv_dtype=args.kv_cache_dtype,
        context_len=parse_tokens(args.context_len) if args.context_len else None,
        gpu_memory=parse_bytes(args.gpu_memory) if args.gpu_memory else None,
        gpu_name=args.gpu, gpu_memory_utilization=args.gpu_memory_utilization,
        weight_format=args.weight_format,
        weights=weights, quantization=args.quantization,
        group_size=args.group_size, reserve=parse_bytes(args.reserve),
        block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
        concurrency=args.concurrency, max_num_seqs=args.max_num_seqs, lengths=args.lengths,
        kv_group_size=args.kv_quant_group_size,
        kv_cache_memory=parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None,
        num_gpu_blocks=args.num_gpu_blocks_override)
    print_report(args, plan, format_plan,
                 lambda path: plot_plan(spec, plan, path, args.kv_quant_group_size))
    return 0
