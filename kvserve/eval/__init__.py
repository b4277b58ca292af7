"""Offline evaluation (held-out perplexity); nothing here is imported by serving."""
