"""One tensor-parallel rank: a process holding its shard of the weights and of the KV pool,
running every step message the engine core sends.

Start-up is two rounds: the worker joins the process group, loads its slice of the checkpoint
and says how many KV blocks its memory holds; the core answers with the count every rank uses
(the smallest: block ids are the same on every rank, one block table), and the worker allocates
its pool and says it is ready. Then it runs steps until told to stop or its pipe closes (the core
is gone: the worker exits rather than linger as an orphan).

Every rank runs the same plan and forward over its own heads; rank 0 alone samples and returns
tokens. A KV chunk moving to or from the storage tiers or swap space holds each KV head once,
side by side (`KVPart`; ranks that share a replicated head, or MLA's latent, share its part):
a load carries the whole chunk and each rank writes its own part.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.worker.step import StepFailed, StepInput, StepOutput
from kvserve.parallel import comm
from kvserve.parallel.channel import GroupLink, Receiver, RelayLink
from kvserve.parallel.message import StepDecoder

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class KVPart:
    """Where a rank's KV sits in a chunk of every rank's: the axis the parts are side by side
    on (heads, or a packed pool's bytes) and this rank's [start, stop) on it."""

    axis: int
    start: int
    stop: int

    def of(self, data: torch.Tensor) -> torch.Tensor:
        return data.narrow(self.axis, self.start, self.stop - self.start)


@dataclass
class WorkerInfo:
    """What a rank tells the core once its pool is allocated."""

    part_size: int  # its width on the chunk axis (KV heads, or a packed page's bytes)
    axis: int
    kv_heads: tuple[int, int]  # which KV heads it stores (ranks sharing one share a part)
    page_bytes: int  # one block of every layer
    weight_line: str


def _rank_for(step: StepInput, part: KVPart) -> StepInput:
    """The step with each load's data cut to this rank's part."""
    plan = step.plan
    if not plan.loads:
        return step
    loads = [replace(load, data=part.of(load.data)) for load in plan.loads]
    return replace(step, plan=replace(plan, loads=loads))


def _slim(out: StepOutput, samples: bool) -> StepOutput:
    """What goes back: rank 0's tokens and logprobs (its logits stay here), every rank's saved
    and swapped KV."""
    if not samples:
        return StepOutput(saved=out.saved, swapped=out.swapped)
    out.logits = out.prompt_logits = torch.empty(0)
    return out


def _error(e: BaseException) -> tuple:
    """An exception as picklable data: ("error", stage, saved, swapped, text, exception)."""
    cause = e.__cause__ if isinstance(e, StepFailed) and e.__cause__ is not None else e
    text = "".join(traceback.format_exception(cause))
    try:
        pickle.dumps(cause)
    except Exception:
        cause = RuntimeError(f"{type(cause).__name__}: {cause}")
    if isinstance(e, StepFailed):
        return ("error", e.stage, e.saved, e.swapped, text, cause)
    return ("error", None, [], {}, text, cause)


def worker_main(config: EngineConfig, rank: int, world_size: int, master: tuple[str, int],
                conn, shm_name: str | None, threads: int,
                exchange: tuple[str, int] | None = None, local_ranks: int | None = None) -> None:
    """The worker process's entry point (torch.multiprocessing spawns it). `conn` and
    `shm_name`: its pipe and the message buffer of the engine core (None on another node: the
    messages come from rank 0, `GroupLink`); `exchange`: the shared-memory buffer (name, slot
    bytes) of the collectives where all ranks are local; `local_ranks`: the ranks on the engine
    core's node (default: all)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
    torch.set_num_threads(threads)
    local = local_ranks or world_size
    pipe = Receiver(conn, shm_name) if conn is not None else None
    try:
        relay = comm.init(rank, world_size, config.device, local)
        if pipe is None:
            link = GroupLink(relay)
        elif relay is not None and rank == 0:
            link = RelayLink(pipe, relay, 1 + world_size - local)
        else:
            link = pipe
        runner, info = _start(config, rank, world_size, link, exchange)
    except BaseException as e:  # noqa: BLE001  the core reports it and stops the others
        if pipe is None:
            raise
        pipe.reply(_error(e))
        return
    link.reply(("ready", info))
    kind, parts = link.receive()
    assert kind == "parts", kind
    part = KVPart(info.axis, *parts[rank])
    link.reply(("ok", None))  # (the core sends nothing more until every rank has read this)
    samples = rank == 0
    runner.samples = samples
    decoder = StepDecoder()
    try:
        while True:
            kind, payload = link.receive()
            if kind == "stop":
                break
            try:
                if kind == "step":
                    step = _rank_for(decoder.decode(payload), part)
                    result = ("ok", _slim(runner.execute(step), samples))
                else:  # "compare"
                    result = ("ok", runner.compare_kv_blocks(payload))
            except Exception as e:  # noqa: BLE001  sent to the core, which decides
                result = _error(e)
            link.reply(result)
    except (EOFError, OSError):
        pass  # the core is gone
    finally:
        link.close()
        comm.close()


def _start(config: EngineConfig, rank: int, world_size: int, link,
           exchange: tuple[str, int] | None) -> tuple[Any, WorkerInfo]:
    """Join the group, load the shard, size and allocate the pool (see the module docstring)."""
    from kvserve.attention.select import make_attention_backend
    from kvserve.worker import builder
    from kvserve.worker.model_runner import ModelRunner
    from kvserve.kv.tensors import KVTensorPool
    from kvserve.layers.plan import TensorParallel
    from kvserve.model_loader.weight_bytes import weight_bytes
    from kvserve.worker.model_build import load_model
    from kvserve.model_loader.tp_layout import rank_config, rank_layout
    from kvserve.parallel.comm import Comm, ShmExchange

    full = builder.model_config_of(config)
    layout = rank_layout(full, rank, world_size)
    sizes = tuple(b - a for a, b in (rank_layout(full, r, world_size).vocab
                                     for r in range(world_size)))
    shm = ShmExchange(exchange[0], rank, world_size, exchange[1]) if exchange else None
    tp = TensorParallel(Comm(rank, world_size, shm), layout.vocab[0], sizes)
    model, _ = load_model(config.model, config.dtype, config.device, shard=layout, tp=tp)
    dtype = next(model.parameters()).dtype
    spec = builder.engine_kv_spec(rank_config(full, layout), dtype, config.block_size,
                                  config.kv_cache_dtype)
    groups = builder.page_groups_of(config, spec)
    link.reply(("sized", builder.num_kv_blocks(config, spec, groups, model)))
    kind, num_blocks = link.receive()
    assert kind == "allocate", kind
    tensors = KVTensorPool(spec, num_blocks, config.device,
                           *builder.kv_scales(config, spec, full, config.model),
                           page_groups=groups)
    backend = make_attention_backend(config.attention_backend, tensors, full.attention_scale,
                                     dtype, full.attn_logit_softcapping)
    runner = ModelRunner(model, backend, tensors, config.block_size, config.seed)
    # CUDA: this rank's decode graphs (NCCL's all-reduces are captured in them)
    builder.capture_graphs(config, runner, model, backend, tensors, groups,
                           rank_config(full, layout))
    heads = spec.layer_specs()[0].tensors[0][0]
    axis, size = (4, tensors.page_bytes) if tensors.packed else (3, heads)
    return runner, WorkerInfo(size, axis, layout.kv_heads,
                              tensors.page_bytes * len(tensors.layers), weight_bytes(model).line())
