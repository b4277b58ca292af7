"""Tensor parallelism (kvserve/parallel/): tensor_parallel_size=2 runs two worker processes of
one thread each. Greedy tokens equal transformers' own continuations (the independent
reference) on Llama, Qwen2 with one KV head (replicated on both ranks), Qwen3, Gemma 3 (hybrid:
sliding and full layers, one block table per group) and DeepSeek-V2 (MLA + MoE), and the top
logprobs equal tp=1's within 1e-4; over block sizes 16 and 7, chunked prefill, preemption,
prefix hits, a host-tier round trip and an fp8 KV cache. A worker killed mid-run fails the
engine within 10 s and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import (generate_checked, hf_greedy, kv_bytes_per_token, random_prompts,
                     save_random_checkpoint)
from test_mla import make_deepseek_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.worker.executor import ExecutorDied
from kvserve.model_loader.tp_layout import check_tp, rank_layout

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

NEW = 10
KV_BYTES = 1 << 20
VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def models(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    S, F = "sliding_attention", "full_attention"
    return {
        "llama": hf_checkpoints["llama"],
        "qwen3": hf_checkpoints["qwen3"],
        "granite": hf_checkpoints["granite"],
        "smollm3": hf_checkpoints["smollm3"],
        "qwen3_moe": hf_checkpoints["qwen3_moe"],
        "mixtral": hf_checkpoints["mixtral"],
        "gemma2": hf_checkpoints["gemma2"],
        "qwen2_1kv": save_random_checkpoint(
            transformers.Qwen2Config(**{**_COMMON, "num_key_value_heads": 1},
                                     tie_word_embeddings=True, rope_theta=1e6),
            root / "qwen2_1kv"),
        "gemma3": save_random_checkpoint(
            transformers.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=8,
                                          layer_types=[S, S, F], query_pre_attn_scalar=24,
                                          final_logit_softcapping=30.0),
            root / "gemma3", perturb_norms=True),
        "deepseek_v2": make_deepseek_checkpoint(root / "deepseek_v2"),
    }


def _llm(path, tp: int, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", tensor_parallel_size=tp,
               **{"block_size": 16, "max_model_len": 512, **kwargs})


def _run(llm: LLM, prompts, logprobs: int | None = None, new: int = NEW):
    """Greedy; with `logprobs`, the top logprobs of every sampled and every prompt token."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=logprobs)
    return generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _max_logprob_gap(a, b) -> float:
    """The largest difference between two runs' top logprobs, of the sampled tokens and of
    the prompt tokens (same tokens, same steps)."""
    gap = 0.0
    for x, y in zip(a, b):
        pairs = list(zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
        pairs += [(dx, dy) for dx, dy in zip(x.prompt_logprobs, y.prompt_logprobs)
                  if dx is not None]
        assert pairs
        for dx, dy in pairs:
            assert dx.keys() == dy.keys()
            gap = max(gap, max(abs(dx[t] - dy[t]) for t in dx))
    return gap


@pytest.mark.parametrize("name", ["llama", "qwen2_1kv", "qwen3", "gemma3", "deepseek_v2",
                                  "granite", "smollm3", "qwen3_moe", "mixtral", "gemma2"])
def test_tp2_equals_transformers_and_tp1(models, name):
    path = models[name]
    prompts = random_prompts([5, 17, 40, 63], VOCAB, seed=1)
    expected = hf_greedy(path, prompts, NEW)
    one = _run(_llm(path, 1), prompts, logprobs=5)
    tp = _llm(path, 2)
    try:
        two = _run(tp, prompts, logprobs=5)
    finally:
        tp.engine.shutdown()
    assert _tokens(two) == expected
    assert _tokens(one) == expected
    assert _max_logprob_gap(one, two) < 1e-4


POOL_BLOCKS = 24  # of 8 tokens: the four requests (70 to 115 tokens) cannot all stay
SCENARIOS = {
    "block7": dict(block_size=7),
    "chunked": dict(max_num_batched_tokens=24),
    "preempt": dict(block_size=8, preemption_mode="recompute"),
    "swap": dict(block_size=8, preemption_mode="swap"),
    "fp8": dict(kv_cache_dtype="fp8"),
    "int8": dict(kv_cache_dtype="int8"),  # a packed pool: per-block pages of data and scales
}


def _pool(path, tp: int) -> dict:
    """kv_cache_memory_bytes of POOL_BLOCKS blocks of 8 tokens per rank (a rank's pool holds
    its half of the KV heads: the budget is per rank, as vLLM's is per GPU)."""
    return dict(kv_cache_memory_bytes=POOL_BLOCKS * 8 * kv_bytes_per_token(path) // tp)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tp2_scenarios_equal_tp1(models, scenario):
    """Llama (2 KV heads: one per rank). fp8: against tp=1's fp8 run (a lossy cache, not
    transformers'); the others against transformers."""
    path = models["llama"]
    kwargs = SCENARIOS[scenario]
    small = scenario in ("preempt", "swap")
    prompts = random_prompts([30, 45, 60, 75], VOCAB, seed=2)
    new = 40 if small else NEW  # decodes that outgrow the pool
    one = _run(_llm(path, 1, **kwargs, **(_pool(path, 1) if small else {})), prompts, new=new)
    tp = _llm(path, 2, **kwargs, **(_pool(path, 2) if small else {}))
    try:
        two = _run(tp, prompts, new=new)
        stats = tp.engine.stats()
    finally:
        tp.engine.shutdown()
    assert _tokens(two) == _tokens(one)
    if scenario not in ("fp8", "int8"):
        assert _tokens(two) == hf_greedy(path, prompts, new)
    if small:
        assert tp.engine.kv.num_blocks == POOL_BLOCKS
        assert stats.num_preemptions > 0
    if scenario == "swap":
        assert stats.swap["swapped_out"] > 0 and stats.swap["bytes_in"] > 0, stats.swap


@pytest.mark.parametrize("name,kv_dtype", [("qwen2_1kv", "auto"), ("llama", "auto"),
                                           ("llama", "int8")])
def test_prefix_hits_and_a_host_tier_round_trip(models, name, kv_dtype):
    """Prompts sharing a 32-token prefix hit the device cache; after the device cache is reset
    the same prompts load their chunks (each KV head once, side by side; the replicated head
    once; int8: each rank's packed pages) from host memory."""
    path = models[name]
    shared = random_prompts([32], VOCAB, seed=3)[0]
    prompts = [shared + p for p in random_prompts([9, 20, 31], VOCAB, seed=4)]
    expected = hf_greedy(path, prompts, NEW) if kv_dtype == "auto" else \
        _tokens(_run(_llm(path, 1, block_size=8, kv_cache_dtype=kv_dtype), prompts))
    tp = _llm(path, 2, block_size=8, kv_cache_dtype=kv_dtype,
              kv_tier_config={"chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.1,
                              "write_policy": "write_through"})
    try:
        assert _tokens(_run(tp, prompts)) == expected
        assert tp.engine.stats().prefix_cache_hits >= 2 * 32
        tp.engine.tiers.flush()
        tp.engine.reset_prefix_cache()
        assert _tokens(_run(tp, prompts)) == expected
        assert tp.engine.stats().hit_tokens["host"] >= 32
        tier = tp.engine.tier_stats()
        assert tier["bytes_loaded"].get("host", 0) > 0 and not tier["errors"], tier
        if name == "qwen2_1kv":  # the one KV head is in every chunk once
            assert tp.engine.executor.rank_parts == (1,)
    finally:
        tp.engine.shutdown()


def test_layouts_split_heads_unevenly_and_replicate_kv_heads(models):
    """SmolLM2-135M's shape (9 heads, 3 KV heads) over 2 ranks is 2 + 1 KV heads; a model with
    one KV head replicates it and splits its query heads; an impossible split is refused."""
    from kvserve.models.config import ModelConfig

    smol = ModelConfig("LlamaForCausalLM", 576, 30, 9, 3, 64, 1536, 49152)
    a, b = (rank_layout(smol, r, 2) for r in range(2))
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert a.vocab == (0, 24576) and b.intermediate == (768, 1536)
    one = ModelConfig("Qwen2ForCausalLM", 64, 2, 4, 1, 16, 128, 512)
    assert [rank_layout(one, r, 2).q_heads for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_layout(one, r, 2).kv_heads for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="multiple"):
        check_tp(ModelConfig("LlamaForCausalLM", 64, 2, 6, 3, 16, 128, 512), 4)


def test_uneven_heads_equal_transformers_and_the_planner(tmp_path, capsys):
    """3 KV heads (6 query heads) over 2 ranks: ranks of 2 and 1 KV heads, pools of different
    page sizes over the same block ids, as `kvserve plan -tp 2` sizes them."""
    path = save_random_checkpoint(
        transformers.LlamaConfig(**{**_COMMON, "num_attention_heads": 6,
                                    "num_key_value_heads": 3, "hidden_size": 96},
                                 tie_word_embeddings=False), tmp_path / "llama3kv")
    prompts = random_prompts([12, 40], VOCAB, seed=5)
    tp = _llm(path, 2, kv_cache_memory_bytes=KV_BYTES)
    try:
        assert _tokens(_run(tp, prompts)) == hf_greedy(path, prompts, NEW)
        _check_plan(path, tp, capsys)
    finally:
        tp.engine.shutdown()


def _check_plan(path, tp: LLM, capsys) -> None:
    """`kvserve plan -tp 2` gives each rank's KV pool as the workers allocated it: the largest
    rank's bytes per block, and the block count every rank holds."""
    import json

    from kvserve.entrypoints.cli import main

    capsys.readouterr()
    assert main(["plan", str(path), "-tp", "2", "--kv-cache-memory", str(KV_BYTES),
                 "--block-size", "16", "--kv-cache-dtype", "fp32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    infos = tp.engine.executor.infos
    assert plan["kv"]["bytes_per_block"] == max(i.page_bytes for i in infos)
    assert plan["capacity"]["num_blocks"] == tp.engine.kv.num_blocks
    assert [i.page_bytes for i in infos] == [2 * 16 * 2 * 16 * 4 * 3, 1 * 16 * 2 * 16 * 4 * 3]


def test_unsupported_models_and_features_are_refused(hf_checkpoints):
    with pytest.raises(ValueError, match="whole projection"):
        _llm(hf_checkpoints["olmo2"], 2)
    with pytest.raises(ValueError, match="partial RoPE"):
        _llm(hf_checkpoints["phi3"], 2)
    with pytest.raises(ValueError, match="bounded KV cache is not supported"):
        _llm(hf_checkpoints["llama"], 2, bounded_kv_policy="streaming", bounded_kv_budget=64)


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)
            if p.name() != "resource_tracker" and "resource_tracker" not in " ".join(p.cmdline())]


def test_a_killed_worker_fails_the_engine_within_10_s_and_every_worker_exits(models):
    import psutil

    tp = _llm(models["llama"], 2)
    procs = tp.engine.executor.procs
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for p in random_prompts([20, 30], VOCAB, seed=6):
        tp.engine.add_request({"prompt_token_ids": p}, params)
    for _ in range(3):
        tp.engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExecutorDied, match="rank 1"):
        for _ in range(1000):
            tp.engine.step()
    assert time.monotonic() - t0 < 10
    for p in procs:
        p.join(10)
        assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == "zombie"
    with pytest.raises(ExecutorDied):  # and it stays dead
        tp.engine.step()
    tp.engine.shutdown()


def test_a_server_whose_worker_dies_answers_503(models, tmp_path):
    """`kvserve serve -tp 2` (a real server process) serves; once a worker is killed, requests
    and /health answer 503 within 10 s and the other worker exits too; SIGINT then stops the
    server with nothing left behind."""
    import httpx
    import psutil
    from server_process import ServerProcess

    path = models["llama"]
    server = ServerProcess("tp2", [str(path), "-tp", "2", "--num-threads", "1",
                                   "--dtype", "float32"], tmp_path)
    try:
        server.wait_ready()
        workers = [p for p in psutil.Process(server.proc.pid).children()
                   if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 2, workers
        prompt = random_prompts([20], VOCAB, seed=7)[0]
        body = {"model": str(path), "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == NEW
        workers[1].kill()
        t0 = time.monotonic()
        status = None
        while time.monotonic() - t0 < 10:
            status = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code
            if status == 503:
                break
            time.sleep(0.2)
        assert status == 503
        assert time.monotonic() - t0 < 10
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        workers[0].wait(10)  # the other worker is stopped too
    finally:
        server.stop()
    assert not any(p.is_running() and p.status() != "zombie" for p in workers)


def test_ranks_on_a_second_node(models, tmp_path):
    """--nnodes 2: rank 1 runs in a `kvserve serve --node-rank 1` process of its own (a second
    node, here on the same machine, joined over MASTER_ADDR/MASTER_PORT) and gets each step
    from rank 0 over the process group; the tokens are transformers', and stopping the leader
    ends the other node's process cleanly."""
    import subprocess
    import sys

    from kvserve.utils.ports import free_port

    path = models["llama"]
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", str(path), "-tp", "2", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--dtype", "float32", "--block-size", "16", "--max-model-len", "512",
         "--num-threads", "1"],
        stdout=open(tmp_path / "node1.log", "wb"), stderr=subprocess.STDOUT)
    try:
        tp = _llm(path, 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        try:
            assert len(tp.engine.executor.procs) == 1  # rank 0 only on this node
            prompts = random_prompts([9, 33], VOCAB, seed=8)
            assert _tokens(_run(tp, prompts)) == hf_greedy(path, prompts, NEW)
        finally:
            tp.engine.shutdown()
        assert node.wait(30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(5)


def test_the_embedded_gguf_model_under_tp2_equals_its_dequantized_tp1():
    """The default model (SmolLM2-135M, a GGUF file: 9 heads and 3 KV heads, so ranks of 2 + 1
    KV heads): each rank dequantizes only its rows of the row-split tensors; the greedy tokens
    equal one process running the same file dequantized (quantization='none')."""
    prompts = random_prompts([24, 61], 49152, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    one = LLM(dtype="float32", quantization="none", max_model_len=256)
    want = _tokens(one.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False))
    tp = LLM(dtype="float32", tensor_parallel_size=2, max_model_len=256)
    try:
        assert [i.kv_heads for i in tp.engine.executor.infos] == [(0, 2), (2, 3)]
        got = _tokens(tp.generate([{"prompt_token_ids": p} for p in prompts], params,
                                  use_tqdm=False))
    finally:
        tp.engine.shutdown()
    assert got == want


def test_kv_audits_compare_every_ranks_heads(models):
    """Hit audits (kv_audit_rate) under tp=2: the recomputed blocks are compared with the
    cached ones on each rank (its own heads; the worst rank counts). Without corruption no
    audit mismatches, and the answers are transformers'."""
    path = models["llama"]
    shared = random_prompts([64], VOCAB, seed=10)[0]
    rounds = [[shared + p for p in random_prompts([5, 9], VOCAB, seed=11 + r)] for r in range(3)]
    tp = _llm(path, 2, kv_audit_rate=1.0)
    try:
        for prompts in rounds:
            assert _tokens(_run(tp, prompts, new=8)) == hf_greedy(path, prompts, 8)
        stats = tp.engine.audit.stats()
    finally:
        tp.engine.shutdown()
    assert stats["audited_hits"] >= 1 and stats["mismatches"] == 0, stats
