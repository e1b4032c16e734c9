"""SRTF: preemptive shortest-remaining-time-first at the requested GPU counts."""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies.base import ClusterView, Policy, Schedule, gang_fill


class SRTF(Policy):
    """Each round, jobs run in order of predicted remaining time (at their requested GPUs and
    batch); jobs that do not fit are skipped so smaller ones can backfill. Jobs pushed out of
    the running set are preempted."""

    name = "srtf"

    def schedule(self, view: ClusterView) -> Schedule:
        ids = view.active
        left = view.predicted_time(ids, view.jobs.req_gpus[ids], view.jobs.req_batch[ids])
        order = ids[np.lexsort((ids, left))]
        return view.place(gang_fill(view, order))
