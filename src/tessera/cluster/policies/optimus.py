"""Optimus (EuroSys'18) as a marginal-gain greedy over GPU counts.

Every active job gets one GPU (in arrival order while GPUs last); then GPUs are added one at a
time to the job whose predicted completion time drops the most from one more GPU
(``remaining / rate(n) - remaining / rate(n + 1)``), until GPUs run out or no job gains. The
global batch stays the one the user chose, so more GPUs mean a smaller per-GPU batch.
"""

from __future__ import annotations

import heapq

import numpy as np

from tessera.cluster.policies.base import ClusterView, Policy, Schedule


class Optimus(Policy):
    """Greedy marginal-gain allocation at fixed batch size."""

    name = "optimus"

    def _max_gpus(self, view: ClusterView, j: int) -> int:
        # Below the smallest profiled per-GPU batch the model would extrapolate.
        min_local = view.models.param("min_local", view.jobs.app[j])
        return max(1, min(view.cluster.gpus, int(view.jobs.req_batch[j] // min_local)))

    def _time(self, view: ClusterView, j: int, n: int) -> float:
        return float(view.predicted_time(j, n, view.jobs.req_batch[j]))

    def schedule(self, view: ClusterView) -> Schedule:
        free = view.cluster.gpus
        counts: dict[int, int] = {}
        heap: list[tuple[float, int]] = []
        for j in view.active[: free]:
            j = int(j)
            counts[j] = 1
            free -= 1
        for j in counts:
            if counts[j] < self._max_gpus(view, j):
                gain = self._time(view, j, 1) - self._time(view, j, 2)
                heapq.heappush(heap, (-gain, j))
        while free > 0 and heap:
            neg_gain, j = heapq.heappop(heap)
            if -neg_gain <= 0:
                break
            counts[j] += 1
            free -= 1
            n = counts[j]
            if n < self._max_gpus(view, j):
                gain = self._time(view, j, n) - self._time(view, j, n + 1)
                heapq.heappush(heap, (-gain, j))
        return view.place(counts)
