"""Micro-benchmark of one `CausalLM.forward` (no attention cost) and of the LM head.

Builds the reference model (`make_model(arch, "small")`, random weights) in a temporary
directory, then times a decode-like step (T=64 tokens) and a prefill-like step (T=8192) with a
dummy attention function that returns q, once with oneDNN-packed weights and once with plain
`F.linear`, interleaved, best of N. GFLOP/s counts 2 x non-embedding parameters x T.

    .venv/bin/python benchmarks/bench_decoder.py [--arch qwen2] [--dtype float32] [--threads 2]

The machines are shared: numbers are only meaningful when nothing else is running.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvserve.worker.model_build import load_model
from kvserve.model_loader.make_model import ARCHS, make_model


def _dummy_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
    return q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 8192])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, args.arch, "small", with_tokenizer=False)
        models = {"packed": load_model(tmp, args.dtype)[0],
                  "F.linear": load_model(tmp, args.dtype, pack_weights=False)[0]}
    if not models["packed"].packed:
        del models["packed"]  # this CPU/dtype cannot use oneDNN packing
    config = models["F.linear"].config
    params = sum(p.numel() for n, p in models["F.linear"].named_parameters()
                 if n not in ("embed_tokens", "lm_head"))
    print(f"{args.arch} small, {args.dtype}, {args.threads} threads, "
          f"{params / 1e6:.2f} M non-embedding parameters")

    with torch.inference_mode():
        for t in args.tokens:
            ids = torch.randint(0, config.vocab_size, (t,))
            pos = torch.arange(t) % config.max_position_embeddings
            best = _best_of(models, lambda m: m(ids, pos, _dummy_attention),
                            repeats=max(3, min(40, 4096 // t)))
            for name, sec in best.items():
                print(f"forward T={t:5d} {name:9s} {sec * 1e3:9.2f} ms "
                      f"{2 * params * t / sec / 1e9:7.1f} GFLOP/s")
        hidden = torch.randn(64, config.hidden_size).to(models["F.linear"].dtype)
        best = _best_of(models, lambda m: m.compute_logits(hidden), repeats=20)
        flops = 2 * 64 * config.vocab_size * config.hidden_size
        for name, sec in best.items():
            print(f"logits  N=   64 {name:9s} {sec * 1e3:9.2f} ms {flops / sec / 1e9:7.1f} GFLOP/s")


def _best_of(models: dict, fn, repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in models}
    for model in models.values():
        fn(model)  # warm-up
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            fn(model)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
