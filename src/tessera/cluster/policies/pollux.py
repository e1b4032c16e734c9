"""A goodput policy in the spirit of Pollux (OSDI'21).

Each job's *speedup* at ``n`` GPUs is its best goodput over batch sizes (throughput x statistical
efficiency, batch between the base batch and the largest profiled one) divided by its goodput on
one GPU at the base batch. GPUs are shared to maximise the power mean with p = -1 of the
speedups (i.e. minimise ``sum 1 / speedup``): every job first gets one GPU in arrival order, then
GPUs go one at a time to the job whose ``1 / speedup`` drops most. A running job only changes
its count when the gain beats the restart it costs: its new speedup is discounted by
``(age - restart_s * restarts) / (age + restart_s)`` (Pollux's restart penalty).

Unlike Pollux this is a greedy, not a genetic search, and it re-tunes the batch only when it
re-allocates; the noise scale comes from the fitted model, not from live gradients.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies.base import (ClusterView, Policy, Schedule,
                                          grow_by_marginal_gain)

BATCH_STEPS = 16  # candidate batch sizes per job, log-spaced between base and max batch


class PolluxLike(Policy):
    """Goodput-driven allocation with batch-size co-adaptation."""

    name = "pollux"

    def _table(self, view: ClusterView, j: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
        """Best goodput and its batch for n = 0..max_n GPUs (packed placement)."""
        jobs, models, gpn = view.jobs, view.models, view.cluster.gpus_per_node
        app = jobs.app[j]
        b0, bmax = models.param("base_batch", app), models.param("max_batch", app)
        lmin = models.param("min_local", app)
        n = np.arange(1, max_n + 1)[:, None]
        b = np.unique(np.round(np.geomspace(b0, bmax, BATCH_STEPS)))[None, :]
        b = np.maximum(b, np.ceil(lmin * n))  # at least the smallest profiled per-GPU batch
        good = models.goodput(app, n, np.ceil(n / gpn), b, jobs.fraction(j))
        best = good.argmax(axis=1)
        g = np.concatenate([[0.0], good[np.arange(max_n), best]])
        return g, np.concatenate([[b0], b[0, best] if b.shape[0] == 1 else
                                  b[np.arange(max_n), best]])

    def schedule(self, view: ClusterView) -> Schedule:
        total = view.cluster.gpus
        max_n = min(total, 64)
        tables, counts, free = {}, {}, total
        for j in (int(x) for x in view.active):
            tables[j] = self._table(view, j, max_n)
            if free > 0:
                counts[j], free = 1, free - 1
        base = {j: t[0][1] for j, t in tables.items()}

        def inv(j: int, n: int) -> float:
            return base[j] / tables[j][0][n]

        grow_by_marginal_gain(counts, free, delta=lambda j, n: inv(j, n + 1) - inv(j, n),
                              limit=lambda j: max_n)
        counts = self._sticky(view, counts, tables)
        batch = {j: int(tables[j][1][n]) for j, n in counts.items()}
        return view.place(counts, batch)

    def _sticky(self, view: ClusterView, counts: dict[int, int], tables) -> dict[int, int]:
        """Keep a running job's count unless the change pays for its restart."""
        jobs = view.jobs
        out = dict(counts)
        for j, n in counts.items():
            old = int(jobs.n[j])
            if old == 0 or old == n:
                continue
            age = max(view.time - jobs.arrival[j], 1.0)
            penalty = max((age - view.restart_s * jobs.restarts[j]) / (age + view.restart_s), 0)
            if tables[j][0][n] * penalty <= tables[j][0][min(old, len(tables[j][0]) - 1)]:
                out[j] = old
        while sum(out.values()) > view.cluster.gpus:  # keeping old counts may overcommit
            j = max((j for j in out if out[j] > counts[j]), key=lambda j: out[j] - counts[j])
            out[j] -= 1
        return {j: n for j, n in out.items() if n > 0}
