"""`kvserve bench kernels --kernel attention | forward | step | sampler` (kernels.py has the
harness, the flags and the GEMMs): paged decode attention against gather + SDPA, one model
forward with packed weights against F.linear, the engine's non-model work per step, and the
sampler with grammar bitmasks against without."""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import tempfile
import time

import torch

from kvserve.bench.timing import CheckError, _ints, check, interleaved
from kvserve.bench.stats import percentile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK = 16


# -- attention -------------------------------------------------------------------------------
def paged_kernel(cxxflags: str):
    """The paged decode kernel, built natively, or with `cxxflags` added (a -march there
    replaces the native one)."""
    from kvserve.attention import cpu_paged
    from kvserve.kernels.cpu import cpu_ext

    extra = tuple(cxxflags.split())
    if not extra:
        return cpu_paged.load_kernel()
    march = any(f.startswith("-march") for f in extra)
    base = tuple(f for f in cpu_ext.CXXFLAGS if not (march and f.startswith("-march")))
    lib = cpu_ext.load_library(cpu_paged.SOURCE, base + extra)
    return cpu_paged.PagedDecodeKernel(lib) if lib is not None else None


class AttentionCase:
    """`seqs` sequences of `context` tokens, `query_rows` consecutive rows each (row r sees
    context + r tokens), over `layers` caches whose blocks lie scattered as a running engine's
    do; queries float32, K/V in `dtype`."""

    def __init__(self, seqs: int, context: int, query_rows: int, layers: int, heads: int,
                 kv_heads: int, dim: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(context * 31 + seqs)
        per = -(-(context + query_rows) // BLOCK)
        order = torch.randperm(seqs * per, generator=gen)
        self.tables = order.view(seqs, per).repeat_interleave(query_rows, 0).contiguous()
        self.lens = (torch.arange(query_rows, dtype=torch.int64).repeat(seqs) + context)
        shape = (seqs * per + 1, BLOCK, kv_heads, dim)
        self.kv = [(torch.randn(shape, generator=gen).to(dtype),
                    torch.randn(shape, generator=gen).to(dtype)) for _ in range(layers)]
        self.q = torch.randn(len(self.lens), heads, dim, generator=gen)
        self.scale = dim ** -0.5
        span = torch.arange(per * BLOCK)
        self.mask = (span[None, :] < self.lens[:, None])[:, None, None, :]

    def sdpa(self, layer: int) -> torch.Tensor:
        """Gather the rows' blocks, then torch's SDPA (masked to each row's length)."""
        k, v = self.kv[layer]
        n, h, d = self.q.shape

        def gather(c: torch.Tensor) -> torch.Tensor:
            return c[self.tables].flatten(1, 2).transpose(1, 2).float()  # [n, Hkv, L, D]

        out = torch.nn.functional.scaled_dot_product_attention(
            self.q[:, :, None, :], gather(k), gather(v), attn_mask=self.mask, scale=self.scale,
            enable_gqa=True)
        return out[:, :, 0, :]


def bench_attention(args: argparse.Namespace) -> list[dict]:
    from kvserve.attention import cpu_paged
    from kvserve.kernels.cpu.cpu_features import l3_cache_bytes
    from kvserve.layers.gemm_select import cache_evictor

    kernel = paged_kernel(args.cxxflags)
    if kernel is None:
        raise SystemExit("the paged decode kernel does not build here")
    evict = None
    if args.cold:
        l3 = l3_cache_bytes()
        evict = cache_evictor(2 * l3 if l3 else None)
    layers = args.layers or 1
    print(f"kernel {kernel.path.name}; {layers} layer(s) x {args.heads}/{args.kv_heads} heads "
          f"x {args.head_dim}, {args.kv_dtype} K/V, "
          f"{'from DRAM (--cold)' if args.cold else 'maybe cached'}; ms per step")
    out = []
    for case in args.cases.split(","):
        seqs, context = (int(x) for x in case.split("x"))
        for rows in _ints(args.query_rows):
            c = AttentionCase(seqs, context, rows, layers, args.heads, args.kv_heads,
                              args.head_dim, DTYPES[args.kv_dtype])
            caches = [cpu_paged.PagedKV(cpu_paged.FLOAT_KINDS[k.dtype], k, v, args.head_dim)
                      for k, v in c.kv]
            res = torch.empty_like(c.q)

            def paged(c=c, caches=caches, res=res):
                step = kernel.step(c.tables, c.lens)
                for kv in caches:
                    step.run(c.q, kv, c.scale, res)
                return res

            def gathered(c=c):
                return [c.sdpa(i) for i in range(layers)][-1]

            paths = {"paged": paged, "sdpa": gathered}
            want = c.sdpa(layers - 1)
            tol = 1e-4 if args.kv_dtype == "float32" else 2e-3
            errs = {n: check(f"attention {case} x {rows} rows {n}", f(), want, atol=tol)
                    for n, f in paths.items()}
            with torch.inference_mode():
                timed = interleaved(paths, args.repeats, before=evict)
            speedup = timed["sdpa"]["min_ms"] / timed["paged"]["min_ms"]
            print(f"{case:>10} x {rows} row(s): paged {timed['paged']['min_ms']:.3f} ms, "
                  f"sdpa {timed['sdpa']['min_ms']:.3f} ms, speed-up {speedup:.2f}x")
            out.append({"case": {"seqs": seqs, "context": context, "query_rows": rows,
                                 "layers": layers}, "paths": timed, "max_abs_err": errs})
    return out


# -- forward ---------------------------------------------------------------------------------
def _no_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    return q


def bench_forward(args: argparse.Namespace) -> list[dict]:
    from kvserve.model_loader.make_model import make_model
    from kvserve.worker.model_build import load_model

    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, args.arch, "small", with_tokenizer=False)
        models = {"F.linear": load_model(tmp, args.dtype, pack_weights=False)[0],
                  "packed": load_model(tmp, args.dtype)[0]}
    if not models["packed"].packed:
        del models["packed"]  # this CPU or dtype cannot use oneDNN packing
    ref = models["F.linear"]
    config = ref.config
    params = sum(p.numel() for n, p in ref.named_parameters()
                 if n not in ("embed_tokens.weight", "lm_head.weight"))
    print(f"{args.arch} small, {args.dtype}, {params / 1e6:.2f} M non-embedding parameters")
    tol = 1e-3 if args.dtype == "float32" else 5e-2
    cases = [(f"forward T={t}", t, 2 * params * t) for t in _ints(args.tokens)]
    cases.append(("logits N=64", 64, 2 * 64 * config.vocab_size * config.hidden_size))
    out = []
    with torch.inference_mode():
        for label, t, flops in cases:
            if label.startswith("logits"):
                x = torch.randn(t, config.hidden_size).to(ref.dtype)
                paths = {n: (lambda m=m: m.compute_logits(x)) for n, m in models.items()}
            else:
                ids = torch.randint(0, config.vocab_size, (t,))
                pos = torch.arange(t) % config.max_position_embeddings
                paths = {n: (lambda m=m: m(ids, pos, _no_attention)) for n, m in models.items()}
            want = paths["F.linear"]()
            errs = {n: check(f"{label} {n}", f(), want, atol=tol * float(want.abs().max()),
                             rtol=tol) for n, f in paths.items()}
            timed = interleaved(paths, max(3, min(args.repeats, 40 * 64 // t + 3)))
            for v in timed.values():
                v["gflop_s"] = flops / v["min_ms"] / 1e6
            print(f"{label:>16}: " + ", ".join(f"{n} {v['min_ms']:.2f} ms "
                                               f"({v['gflop_s']:.1f} GFLOP/s)"
                                               for n, v in timed.items()))
            out.append({"case": {"label": label, "tokens": t}, "paths": timed,
                        "max_abs_err": errs})
    return out


# -- step ------------------------------------------------------------------------------------
def step_costs(num_running: int, steps: int, seed: int = 0) -> dict:
    """Seconds of schedule() + update_from_output() per decode step with every request running
    (128-token prompts, every 4th sharing a 64-token prefix), and the step message's pickle.
    The sampled tokens are drawn untimed: they are the worker's."""
    from kvserve.config import EngineConfig
    from kvserve.engine.scheduler import Scheduler
    from kvserve.kv.manager import KVCacheManager
    from kvserve.request import Request
    from kvserve.sampling import SamplingParams
    from kvserve.worker.step import StepOutput

    rng = random.Random(seed)
    max_len = 128 + steps + 64
    config = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running),
                          block_size=BLOCK, device="cpu")
    config.finalize(max_len)
    sched = Scheduler(config, KVCacheManager(num_running * -(-max_len // BLOCK) + 64, BLOCK))
    shared = [rng.randrange(32000) for _ in range(64)]
    params = SamplingParams(max_tokens=max_len - 128)
    for i in range(num_running):
        tail = [rng.randrange(32000) for _ in range(64 if i % 4 == 0 else 128)]
        sched.add(Request(str(i), shared + tail if i % 4 == 0 else tail, params, max_len - 128))
    times, pickled, sizes = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        batch = sched.schedule()
        elapsed = time.perf_counter() - t
        t = time.perf_counter()
        message = pickle.dumps(batch.step, protocol=pickle.HIGHEST_PROTOCOL)
        pickle_s = time.perf_counter() - t
        sampled = [i for i, seq in enumerate(batch.step.seqs) if seq.samples]
        out = StepOutput(sampled=sampled, tokens=[rng.randrange(32000) for _ in sampled],
                         logprobs=[None] * len(sampled))
        t = time.perf_counter()
        sched.update_from_output(batch, out)
        elapsed += time.perf_counter() - t
        if not sched.waiting and all(n == 1 for n in batch.num_new_tokens):
            times.append(elapsed)
            pickled.append(pickle_s)
            sizes.append(len(message))
    return {"times": times, "pickle": pickled, "message_kb": statistics.median(sizes) / 1024}


def bench_step(args: argparse.Namespace) -> list[dict]:
    out = []
    for n in _ints(args.running):
        r = step_costs(n, args.steps)
        ms = [1e3 * t for t in r["times"]]
        paths = {"step": {"min_ms": min(ms), "median_ms": statistics.median(ms),
                          "p90_ms": percentile(ms, 90)},
                 "pickle": {"min_ms": 1e3 * min(r["pickle"]),
                            "median_ms": 1e3 * statistics.median(r["pickle"])}}
        print(f"{n:>6} running: {len(ms)} decode steps, median {paths['step']['median_ms']:.3f}"
              f" ms, p90 {paths['step']['p90_ms']:.3f} ms; step message "
              f"{r['message_kb']:.1f} KB, pickled in {paths['pickle']['median_ms']:.3f} ms")
        out.append({"case": {"running": n, "decode_steps": len(ms),
                             "message_kb": r["message_kb"]}, "paths": paths})
    return out


# -- sampler ---------------------------------------------------------------------------------
def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Bit `token` of packed int32 row `row`: the grammar's verdict, read without the sampler."""
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def bench_sampler(args: argparse.Namespace) -> list[dict]:
    """Structured outputs' sampler cost: a [--batch, vocab] step of the sampler alone (no
    model, so a shared machine's noise matters less), no bitmask against --fraction of the
    rows masked, greedy and random. Checked first: greedy rows take torch.argmax, and every
    masked row's token is one its bitmask allows."""
    from kvserve import SamplingParams
    from kvserve.sampler import Sampler, SamplingRow

    constrained = round(args.batch * args.fraction)
    out = []
    for vocab in (8192, 32000):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(args.batch, vocab, generator=g)
        bitmask = torch.randint(-2**31, 2**31 - 1, (max(constrained, 1), (vocab + 31) // 32),
                                generator=g, dtype=torch.int32)
        for temperature, label in ((0.0, "greedy"), (1.0, "random")):
            params = SamplingParams(temperature=temperature)
            plain = [SamplingRow(params) for _ in range(args.batch)]
            masked = [SamplingRow(params, bitmask_row=i if i < constrained else None)
                      for i in range(args.batch)]
            sampler = Sampler(seed=0)
            got = sampler(logits, masked, bitmask).token_ids
            bad = [i for i in range(constrained) if not _allowed(bitmask, i, got[i])]
            if bad:
                raise CheckError(f"sampler: masked rows {bad[:5]} took disallowed tokens")
            if temperature == 0.0:
                check("sampler greedy", torch.tensor(sampler(logits, plain).token_ids),
                      logits.argmax(dim=-1), atol=0)
            timed = interleaved({"plain": lambda: sampler(logits, plain),
                                 "masked": lambda: sampler(logits, masked, bitmask)},
                                args.repeats)
            ratio = timed["masked"]["median_ms"] / timed["plain"]["median_ms"]
            print(f"vocab {vocab:>6} {label:<7} {args.batch} rows, {constrained} masked: "
                  f"no mask {timed['plain']['median_ms']:.3f} ms, masked "
                  f"{timed['masked']['median_ms']:.3f} ms ({ratio:.2f}x)")
            out.append({"case": {"vocab": vocab, "sampling": label, "rows": args.batch,
                                 "masked": constrained}, "paths": timed})
    return out
