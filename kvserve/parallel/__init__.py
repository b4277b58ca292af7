"""Tensor parallelism: one model split across worker processes (`tensor_parallel_size`).

The layout (which heads, MLP columns and vocabulary rows each rank holds) and the slices a rank
reads from a checkpoint are the loader's: kvserve/model_loader/tp_layout.py and tp_shard.py,
which the planner reads too.

comm.py      the collectives a sharded forward runs (torch.distributed)
layers.py    the sharded layers' methods: row-parallel projections, vocabulary-parallel
             embedding and LM head
channel.py   the step message from the engine core to every worker (shared memory + pipes;
             rank 0 relays it to other nodes)
message.py   the step message's encoding (columns; block tables only where they changed)
worker.py    one rank's process: its shard of the model and of the KV pool, a step loop
executor.py  the engine core's side: starts the workers, sends each step, gathers the result
build.py     the engine core's parts without a model; a node's headless ranks
"""
