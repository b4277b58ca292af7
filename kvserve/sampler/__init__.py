"""The sampler, split by responsibility: `sampler.Sampler` (the entry point the worker calls once
a step, its workspace, the logprobs), `rows` (what a row is and the step's plan), `logit_changes`
(bias, grammar, min_tokens, penalties), `truncation` (top-k/top-p as one threshold) and `draw`
(the uniform numbers and the inverse-CDF draw). The names callers use are here."""

from kvserve.sampler.rows import GREEDY_EPS, SampleResult, SamplingRow
from kvserve.sampler.sampler import Sampler

__all__ = ["GREEDY_EPS", "SampleResult", "Sampler", "SamplingRow"]
