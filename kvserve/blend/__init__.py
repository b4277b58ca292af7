"""Document reuse anywhere in the prompt (CacheBlend): position-independent KV of marked
spans, placed at their actual positions with a share of their tokens recomputed."""
