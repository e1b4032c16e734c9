"""Tiresias (NSDI'19): discretised two-dimensional least-attained-service.

A job's attained service is GPUs x seconds it has held GPUs. Jobs sit in priority queues by
attained service (queue k holds jobs with ``thresholds[k-1] <= service < thresholds[k]``); queues
are served in order, FIFO by arrival inside a queue, each job with its requested GPU count,
skipping jobs that do not fit. Jobs that lose their place are preempted. Needing no job model
is Tiresias' point: it is information-agnostic.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies.base import ClusterView, Policy, Schedule, gang_fill

# Pollux's evaluation used two queues split at 16 GPU-hours.
DEFAULT_THRESHOLDS_GPU_H = (16.0,)


class Tiresias(Policy):
    """Discretised 2D-LAS.

    Args:
        thresholds_gpu_h: queue boundaries in GPU-hours of attained service (ascending).
    """

    name = "tiresias"

    def __init__(self, thresholds_gpu_h: tuple[float, ...] = DEFAULT_THRESHOLDS_GPU_H) -> None:
        if list(thresholds_gpu_h) != sorted(thresholds_gpu_h):
            raise ValueError("queue thresholds must be ascending")
        self.thresholds_s = np.asarray(thresholds_gpu_h, dtype=float) * 3600.0

    def queues(self, view: ClusterView, ids: np.ndarray) -> np.ndarray:
        """Queue index (0 = highest priority) of each job."""
        return np.searchsorted(self.thresholds_s, view.jobs.attained[ids], side="right")

    def schedule(self, view: ClusterView) -> Schedule:
        ids = view.active
        order = ids[np.lexsort((ids, view.jobs.arrival[ids], self.queues(view, ids)))]
        return view.place(gang_fill(view, order))
