"""Optimus (EuroSys'18) as a marginal-gain greedy over GPU counts.

Every active job gets one GPU (in arrival order while GPUs last); then GPUs are added one at a
time to the job whose predicted completion time drops the most from one more GPU
(``remaining / rate(n) - remaining / rate(n + 1)``), until GPUs run out or no job gains. The
global batch stays the one the user chose, so more GPUs mean a smaller per-GPU batch.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies.base import (ClusterView, Policy, Schedule,
                                          grow_by_marginal_gain)


class Optimus(Policy):
    """Greedy marginal-gain allocation at fixed batch size."""

    name = "optimus"

    def _times(self, view: ClusterView, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(J, N+2) predicted seconds to finish at 0..N+1 GPUs, and each job's GPU limit."""
        j = view.jobs
        # Below the smallest profiled per-GPU batch the model would extrapolate.
        min_local = view.models.param("min_local", j.app[ids])
        limit = np.clip(j.req_batch[ids] // min_local, 1, view.cluster.gpus).astype(np.int64)
        top = int(limit.max()) + 1
        n = np.arange(top + 1)[None, :]
        t = view.predicted_time(ids[:, None], np.maximum(n, 1), j.req_batch[ids][:, None])
        return t, limit

    def schedule(self, view: ClusterView) -> Schedule:
        ids = view.active[: view.cluster.gpus]  # one GPU each, in arrival order, while they last
        if ids.size == 0:
            return {}
        times, limit = self._times(view, ids)
        counts = grow_by_marginal_gain(
            dict.fromkeys(range(ids.size), 1), view.cluster.gpus - ids.size,
            delta=lambda i, n: times[i, n + 1] - times[i, n], limit=lambda i: limit[i])
        return view.place({int(ids[i]): int(c) for i, c in counts.items()})
