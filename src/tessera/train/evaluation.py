"""Which evaluation samples each data-parallel rank reads, in micro-batches."""

from __future__ import annotations

import math
from typing import Iterator


def eval_micro_batches(n_samples: int, global_batch: int, dp: int, dp_rank: int, mbs: int,
                       batches: int) -> Iterator[tuple[list[int], int]]:
    """(sample indices, how many of them count) of each micro-batch this rank evaluates.

    Global batch b covers samples ``b * global_batch ...``; each dp rank takes its contiguous
    share of it in micro-batches of ``mbs`` (the shape a pipeline's program was captured
    for), so every layout with the same global batch reads the same samples.

    ``batches`` > 0: that many global batches, wrapping around a shorter set; every sample
    counts. ``batches`` == 0: the whole set, each sample once: the last global batch is filled
    up with wrapped-around samples that do not count (their labels are to be masked).
    """
    whole = batches == 0
    batches = math.ceil(n_samples / global_batch) if whole else batches
    per_rank = global_batch // dp
    for b in range(batches):
        first = b * global_batch + dp_rank * per_rank
        for start in range(first, first + per_rank, mbs):
            positions = range(start, start + mbs)
            real = sum(p < n_samples for p in positions) if whole else mbs
            yield [p % n_samples for p in positions], real
