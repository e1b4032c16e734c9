"""Which evaluation samples each data-parallel rank reads, in micro-batches, and the
micro-batch sizes a layout can evaluate in."""

from __future__ import annotations

import math
from typing import Iterator

from tessera.strategy import Strategy, StrategyError


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


def check_eval_micro_batch(size: int, strategy: Strategy,
                           name: str = "train.eval_micro_batch_size",
                           unset: str = "leave it 0") -> None:
    """Refuse an evaluation micro-batch size the layout cannot run (0: the training one).

    Args:
        name, unset: the argument as the caller's user knows it, and how to leave it unset.

    Raises:
        StrategyError: naming the size and the rule.
    """
    if not size or size == strategy.micro_batch_size:
        return
    if strategy.pp > 1:
        raise StrategyError(f"{name}={size} differs from mbs="
                            f"{strategy.micro_batch_size}, but pipeline stages (pp="
                            f"{strategy.pp}) run the training micro-batch shape: {unset}")
    q = strategy.tp_grid[0]
    if strategy.tp_mode == "2d" and size % q:
        raise StrategyError(f"{name}={size}: 2D tensor parallelism "
                            f"splits each micro-batch over {q} grid rows, so it must be "
                            f"divisible by {q}")
