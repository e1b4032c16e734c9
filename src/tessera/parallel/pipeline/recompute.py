"""Stage-aware recomputation: how much each pipeline stage recomputes.

Under 1F1B, stage s of S holds S - s micro-batches in flight at its peak, so the first stage
needs the most activation memory and the last the least. Recomputing the same share on every
stage wastes time on the later ones. Two ways to choose per-stage ratios:

- from a memory budget (:func:`stage_aware_ratios`; the Trainer's
  ``train.stage_memory_budget``): each stage takes the smallest ratio whose peak (weights and
  optimizer states + in-flight activations) fits;
- from the first stage's ratio (:func:`ratios_from_first`, Merak's rule): the activation
  memory the first stage keeps, (1 - r0) * (S - 1) micro-batches' worth for stages that
  recompute, is what each later stage may keep over its S - 1 - s micro-batches.

The result is a Strategy's ``recompute=`` per-stage text, e.g. ``recompute=1/0.67/0/0``.
"""

from __future__ import annotations

from typing import Sequence

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.partition import Partition, partition


def stage_aware_ratios(graph: ProxyGraph, stages: int, micro_batches: int,
                       memory_limit: float, schedule: str = "1f1b",
                       rates: DeviceRates = DeviceRates()) -> Partition:
    """Partition with per-stage recomputation chosen from ``memory_limit`` bytes per stage.

    The partitioner picks cuts and ratios together: a stage that would not fit recomputes a
    larger share, and the balance accounts for the recomputation time. Earlier stages, with
    more micro-batches in flight, end up with ratios at least as large as later ones when the
    stages are alike. Returns the Partition; its ``recompute`` is the per-stage ratios.
    """
    return partition(graph, stages, micro_batches, schedule, memory_limit=memory_limit,
                     recompute=None, rates=rates)


def ratios_from_first(first: float, stages: int) -> tuple[float, ...]:
    """Merak's rule: r_s = 1 - (1 - r_0)(S - 1) / (S - 1 - s), clipped to [0, 1]; r_last = 0."""
    out = []
    for s in range(stages):
        if s == stages - 1:
            out.append(0.0)
            continue
        ratio = 1 - (1 - first) * (stages - 1) / (stages - 1 - s)
        out.append(min(1.0, max(0.0, ratio)))
    return tuple(out)


def strategy_text(ratios: Sequence[float]) -> str:
    """``recompute=`` text for a Strategy, e.g. ``1/0.5/0``."""
    return "/".join(f"{r:g}" for r in ratios)
