"""The engine core's parts under tensor parallelism: everything but the model and the KV pool,
which live in the workers (kvserve/parallel/worker.py).

The core reads only the model's config: it finalizes the engine config against it, checks the
features, starts the workers, and takes the smallest of their KV block counts (every rank uses
the same block ids). Its own view of the pool is a `meta`-device KVTensorPool of the whole
model's spec: the same page sizes, formats and flags the scheduler, the swap space and the
tiers' chunk key read, with no memory behind it.
"""

from __future__ import annotations

import logging
import os

from kvserve.config import EngineConfig
from kvserve.worker import builder
from kvserve.kv.spec import capacity_line
from kvserve.kv.tensors import KVTensorPool
from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
from kvserve.layers.selection import resolve_dtype
from kvserve.parallel.comm import exchange_slot_bytes
from kvserve.parallel.executor import MultiprocExecutor
from kvserve.model_loader.tp_layout import check_tp
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve")


class RemoteBackend:
    """What the engine core asks of the attention backend, for one that runs in the workers."""

    observes_attention = False


def _finalize(config: EngineConfig):
    """The model's config and dtype, the engine config finalized against them (every node
    does the same, so that each worker reads the same limits)."""
    model_config = builder.model_config_of(config)  # (config.model resolved)
    check_tp(model_config, config.tensor_parallel_size)
    dtype = resolve_dtype(config.dtype, model_config, config.device)
    config.finalize(model_config.max_position_embeddings)
    builder.check_model_features(config, model_config, dtype)
    return model_config, dtype


def build_parallel_engine(config: EngineConfig) -> builder.EngineParts:
    tp = config.tensor_parallel_size
    model_config, dtype = _finalize(config)
    model_dir = config.model
    tokenizer = Tokenizer.from_dir(config.tokenizer or tokenizer_dir(model_dir))
    kv_spec = builder.engine_kv_spec(model_config, dtype, config.block_size,
                                     config.kv_cache_dtype)
    groups = builder.page_groups_of(config, kv_spec)
    executor = MultiprocExecutor(config, tp, exchange_slot_bytes(config, model_config, tp))
    try:
        counts = executor.sized()
        num_blocks = min(counts)
        infos = executor.allocate(num_blocks)
        tensors = KVTensorPool(kv_spec, num_blocks, "meta",
                               *builder.kv_scales(config, kv_spec, model_config, model_dir),
                               page_groups=groups)
        tiers, kv = builder.make_kv_manager(config, kv_spec, model_config, tensors, groups,
                                            num_blocks, executor.rank_parts)
    except BaseException:
        executor.shutdown()
        raise
    for rank, info in enumerate(infos):
        logger.info("tensor parallel rank %d/%d: KV heads %d-%d; %s; KV pool %.1f MB", rank, tp,
                    info.kv_heads[0], info.kv_heads[1] - 1, info.weight_line,
                    num_blocks * info.page_bytes / 1e6)
    logger.info(capacity_line(num_blocks, config.block_size, config.max_model_len,
                              kv.final_blocks(config.max_model_len), kv.num_groups))
    return builder.EngineParts(None, model_config, tokenizer, dtype, kv_spec, groups, tensors,
                               RemoteBackend(), tiers, kv, None, executor)


def run_node(config: EngineConfig) -> int:
    """A node other than the leader (`--node-rank` > 0): its share of the ranks, which take
    their step messages from rank 0 over the process group; returns when they exit (the
    leader stopped, or failed). No engine core and no API here."""
    import torch.multiprocessing as mp

    from kvserve.parallel.executor import rendezvous
    from kvserve.parallel.worker import worker_main

    _finalize(config)
    tp, local = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // local)
    ranks = range(config.node_rank * local, (config.node_rank + 1) * local)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"kvserve-tp{rank}", daemon=True,
                         args=(config, rank, tp, rendezvous(config), None, None, threads, None,
                               local))
             for rank in ranks]
    for p in procs:
        p.start()
    logger.info("node %d of %d: tensor-parallel ranks %d-%d of %d, leader at %s:%d",
                config.node_rank, config.nnodes, ranks[0], ranks[-1], tp, *rendezvous(config))
    for p in procs:
        p.join()
    failed = [p for p in procs if p.exitcode]
    for p in procs:
        if p.is_alive():
            p.kill()
    return 1 if failed else 0
