"""The worker side of a step: what runs the model on a step message, apart from the engine core
that builds the message (the scheduler and the KV manager, kvserve/engine) and below both the
core and tensor parallelism (kvserve/parallel), which start workers of their own.

`step.py` (StepInput / SeqStep / StepOutput: a step as plain data), `executor.py` (hands steps to
the workers: in process, or tensor parallelism's ranks), `model_runner.py` (runs a step's KV plan,
the forward and the sampling), `step_sampler.py` (the sampling and its per-request state),
`builder.py` (the parts from the config: model, KV pool sizing and layout, tiers, runner, CUDA
graphs), `cuda_graphs.py` (decode CUDA graphs), `gpu_memory.py` (KV pool sizing on a GPU).
Nothing here imports the engine core.
"""
