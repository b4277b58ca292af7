"""Where a step message goes: the seam between the scheduler's side and the workers.

The engine hands every step (worker/step.py's StepInput) to an Executor and gets a StepOutput
back; it never calls the worker itself. InProcessExecutor runs one worker in this process;
tensor parallelism's (kvserve/parallel/executor.py) sends the same message to one worker
process per rank and returns rank 0's output. (vLLM v1's Executor: UniProcExecutor,
MultiprocExecutor.)
"""

from __future__ import annotations

from typing import Protocol

from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.step import StepInput, StepOutput


class ExecutorDied(RuntimeError):
    """The workers are gone (one died, or raised while the others waited for it): no step can
    run any more. The engine loop stops on it (the server answers 503) rather than fail one
    step's requests and go on."""


class Executor(Protocol):
    def execute(self, step: StepInput) -> StepOutput:
        """Run the step's plan and forward; raises what the worker raised (StepFailed once
        the plan's saves were read)."""

    def compare_kv_blocks(self, pairs: list[tuple[int, int]]) -> list[tuple[float, float]]:
        """Per (recomputed, cached) pair of block ids, how far apart their KV is (a KV audit,
        engine/audit.py): (largest, mean) difference over the recomputed block's magnitude,
        the worst of every layer; inf for non-finite KV. Called between steps; an executor
        over several ranks (each holding some heads) returns the worst of its ranks."""

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """The worker in this process, called directly: no copy of the message, no thread."""

    def __init__(self, worker: ModelRunner) -> None:
        self.worker = worker

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def compare_kv_blocks(self, pairs: list[tuple[int, int]]) -> list[tuple[float, float]]:
        return self.worker.compare_kv_blocks(pairs)

    def shutdown(self) -> None:
        pass
