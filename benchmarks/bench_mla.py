"""MLA (DeepSeek-V2) on the CPU, float32: absorbed against decompressing decode, medians of
--repeats, the two modes interleaved in one process:

1. one attention layer of DeepSeek-V2's real shape over the paged latent cache
   (`TorchMLABackend(decode=...)`), at a short and a long context;
2. the same choice end to end: `make-model --arch deepseek_v2 --size small`'s decode with the
   engine's backend switched.

Decode against transformers on that model is benchmarks/bench_throughput.py with --model
(docs/figures/mla.md gives the command).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_mla.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.kv.spec import KVStorage, decoder_kv_spec
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.base import AttentionMetadata, SequenceSlice
from kvserve.attention.mla import MLAProjections, TorchMLABackend
from kvserve.bench.record import current_machine
from kvserve.model_loader.make_model import make_model


def kvserve_decode_time(llm: LLM, ps: list[list[int]], new: int) -> float:
    """Seconds of the engine steps after every request has its first token (pure decode
    steps: batch x (new - 1) tokens)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in ps]
    running = {r.request_id: r for r in engine.scheduler.running}
    while engine.has_unfinished_requests():
        running.update({r.request_id: r for r in engine.scheduler.running})
        if len(running) == len(ids) and all(r.output_token_ids for r in running.values()):
            break
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


# -- 1. absorbed vs decompressing, one layer of DeepSeek-V2's shape ----------------------------
def layer_setup(batch: int, context: int, heads: int, rank: int, rope: int, nope: int,
                v_dim: int, block_size: int = 16):
    blocks = -(-context // block_size)
    spec = decoder_kv_spec(1, 1, 1, KVStorage("fp32"), block_size, kv_lora_rank=rank,
                           rope_dim=rope)
    pool = KVTensorPool(spec, batch * blocks)
    pool.layers[0][0].normal_()
    decodes = [SequenceSlice(i, 1, context, list(range(i * blocks, (i + 1) * blocks)))
               for i in range(batch)]
    slots = torch.tensor([(i * blocks) * block_size + context - 1 for i in range(batch)])
    meta = AttentionMetadata(slots, [], decodes, 0)
    proj = MLAProjections.of(torch.randn(heads * (nope + v_dim), rank) * 0.05, heads, nope, v_dim)
    q_nope, q_rope = torch.randn(batch, heads, nope), torch.randn(batch, heads, rope)
    new = torch.randn(batch, rank + rope)
    return pool, meta, proj, q_nope, q_rope, new


def absorbed_vs_decompress_layer(batch: int, contexts: list[int], repeats: int) -> None:
    shape = dict(heads=128, rank=512, rope=64, nope=128, v_dim=128)
    print(f"\n1. one MLA layer, DeepSeek-V2's shape ({shape}), batch {batch}, float32: decode "
          "attention incl. the up-projections")
    print(f"   {'context':>7} {'absorbed ms':>12} {'decompress ms':>14} {'absorbed wins by':>17}")
    for context in contexts:
        pool, meta, proj, q_nope, q_rope, new = layer_setup(batch, context, **shape)
        fns = {mode: TorchMLABackend(pool, 0.07, decode=mode) for mode in ("absorbed",
                                                                           "decompress")}
        times: dict[str, list[float]] = {m: [] for m in fns}
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms up
                for mode, backend in fns.items():
                    attend = backend.bind(meta)
                    start = time.perf_counter()
                    attend(0, q_nope, q_rope, new, proj)
                    times[mode].append(time.perf_counter() - start)
        a = statistics.median(times["absorbed"][1:])
        d = statistics.median(times["decompress"][1:])
        print(f"   {context:>7} {a * 1e3:>12.2f} {d * 1e3:>14.2f} {d / a:>16.1f}x")


# -- 2. the same, end to end --------------------------------------------------------------------
def absorbed_vs_decompress_engine(path: Path, batch: int, contexts: list[int], new: int,
                                  repeats: int) -> None:
    print(f"\n2. the small model end to end, batch {batch}, {new} new tokens: decode tok/s "
          "with the engine's MLA backend absorbed vs decompressing")
    print(f"   {'context':>7} {'absorbed':>9} {'decompress':>11} {'absorbed wins by':>17}")
    for context in contexts:
        llm = LLM(model=str(path), dtype="float32", max_model_len=context + new + 16,
                  max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 64),
                  enable_prefix_caching=False)
        vocab, g = llm.engine.model_config.vocab_size, torch.Generator().manual_seed(context)
        ps = torch.randint(3, vocab, (batch, context), generator=g).tolist()
        backend = llm.engine.backend
        times: dict[str, list[float]] = {"absorbed": [], "decompress": []}
        kvserve_decode_time(llm, ps, 3)
        for _ in range(repeats):
            for mode in times:
                backend.decode_mode = mode
                times[mode].append(kvserve_decode_time(llm, ps, new))
        a = batch * (new - 1) / statistics.median(times["absorbed"])
        d = batch * (new - 1) / statistics.median(times["decompress"])
        print(f"   {context:>7} {a:>9.1f} {d:>11.1f} {a / d:>16.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new", type=int, default=32, help="decode tokens in part 2")
    p.add_argument("--layer-batch", type=int, default=4)
    p.add_argument("--layer-contexts", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--engine-batch", type=int, default=8)
    p.add_argument("--engine-contexts", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--skip", nargs="*", default=[], choices=["1", "2"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{current_machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "1" not in args.skip:
        absorbed_vs_decompress_layer(args.layer_batch, args.layer_contexts, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "ds", arch="deepseek_v2", size="small")
        if "2" not in args.skip:
            absorbed_vs_decompress_engine(path, args.engine_batch, args.engine_contexts,
                                          args.new, args.repeats)


if __name__ == "__main__":
    main()
