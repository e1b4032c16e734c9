"""FIFO: jobs start in arrival order with the GPUs they asked for and are never preempted."""

from __future__ import annotations

from tessera.cluster.policies.base import ClusterView, Policy, Schedule


class FIFO(Policy):
    """First in, first out, with strict head-of-line blocking (no backfilling).

    A queued job that does not fit blocks every job behind it, so start order equals arrival
    order.
    """

    name = "fifo"
    periodic = False

    def schedule(self, view: ClusterView) -> Schedule:
        free = view.cluster.gpus
        counts = {}
        for j in view.running():
            counts[int(j)] = int(view.jobs.n[j])
            free -= counts[int(j)]
        for j in view.active:
            j = int(j)
            if j in counts:
                continue
            want = int(view.jobs.req_gpus[j])
            if want > free:
                break
            counts[j] = want
            free -= want
        return view.place(counts)
