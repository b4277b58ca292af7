"""Row buckets: the batch sizes a kernel choice is made for. A decode step has as many rows as
running sequences, a prefill step up to max_num_batched_tokens; the GEMM plan
(`kvserve.layers.gemm_select`) picks a kernel per projection and bucket, and a layer holds one
set of methods per bucket (`LayerMethods`), chosen once per step by `bucket_of`."""

from __future__ import annotations

# (largest row count in the bucket, the row count measured for it). The probe of the last
# bucket is deliberately not a rounded size, so oneDNN's padding is paid.
BUCKETS: tuple[tuple[float, int], ...] = ((4, 1), (32, 16), (128, 64), (512, 256),
                                          (float("inf"), 1000))
BUCKET_LABELS = ("<=4", "<=32", "<=128", "<=512", ">512")
NUM_BUCKETS = len(BUCKETS)


def bucket_of(rows: int) -> int:
    """Index into BUCKETS of a GEMM with `rows` rows."""
    for i, (limit, _) in enumerate(BUCKETS):
        if rows <= limit:
            return i
    return len(BUCKETS) - 1
