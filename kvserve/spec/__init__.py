"""Speculative decoding drafted from what the engine already holds: the request's own tokens
(n-gram prompt lookup) and, next, the prefix index (suffix), or from a second, smaller model
(draft_model.py). config.py reads vLLM's `speculative_config`; ngram.py drafts; speculator.py
decides per request and step how many tokens to draft and keeps the acceptance counters. The
verification itself is the worker's (kvserve/worker/spec_verify.py): it sees logits, these
modules see only tokens."""
