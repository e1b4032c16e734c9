"""The interface every scheduling policy implements, and what it is shown each round."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Hashable, NamedTuple

import heapq

import numpy as np

from tessera.cluster.job_model import JobModels
from tessera.cluster.jobs import JobTable
from tessera.cluster.placement import place


class Assignment(NamedTuple):
    """What one job gets this round: concrete GPU ids and its global batch size."""

    gpus: np.ndarray
    batch: int


Schedule = dict[int, Assignment]


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster of ``nodes`` machines with ``gpus_per_node`` GPUs each."""

    nodes: int
    gpus_per_node: int = 4

    @property
    def gpus(self) -> int:
        """Total GPUs."""
        return self.nodes * self.gpus_per_node

    @classmethod
    def with_gpus(cls, gpus: int, gpus_per_node: int = 4) -> "ClusterSpec":
        """A cluster of ``gpus`` GPUs (a multiple of ``gpus_per_node``)."""
        if gpus < 1 or gpus % gpus_per_node:
            raise ValueError(f"gpus={gpus} must be a positive multiple of gpus_per_node="
                             f"{gpus_per_node}")
        return cls(gpus // gpus_per_node, gpus_per_node)


@dataclass
class ClusterView:
    """The simulator state a policy may read (it must not write it).

    Attributes:
        time: simulated seconds now.
        cluster: the cluster.
        models: the fitted job models.
        jobs: the job table (static fields and live state).
        active: ids of jobs that have arrived and not finished, in arrival order.
        owner: job id holding each GPU (-1 free).
        restart_s: seconds a job loses each time its GPUs change.
        changed: True if jobs arrived or finished since the previous round.
        noise: multiplicative error applied to predicted remaining work, per job.
    """

    time: float
    cluster: ClusterSpec
    models: JobModels
    jobs: JobTable
    active: np.ndarray
    owner: np.ndarray
    restart_s: float
    changed: bool
    noise: np.ndarray

    def remaining(self, ids) -> np.ndarray:
        """Predicted remaining progress (base-batch samples) of jobs ``ids``."""
        j = self.jobs
        return np.maximum(j.work[ids] - j.progress[ids], 0.0) * self.noise[ids]

    def predicted_time(self, ids, gpus, batch) -> np.ndarray:
        """Predicted seconds to finish at ``gpus`` (packed on few nodes) and ``batch``."""
        j = self.jobs
        nodes = np.ceil(np.asarray(gpus) / self.cluster.gpus_per_node)
        rate = self.models.goodput(j.app[ids], gpus, nodes, batch, j.fraction(ids))
        with np.errstate(divide="ignore"):
            return np.where(rate > 0, self.remaining(ids) / np.maximum(rate, 1e-30), np.inf)

    def running(self) -> np.ndarray:
        """Ids of active jobs that hold GPUs now."""
        return self.active[self.jobs.n[self.active] > 0]

    def place(self, counts: dict[int, int], batch: dict[int, int] | None = None) -> Schedule:
        """A schedule giving each job its count, moving as few jobs as possible.

        Args:
            counts: job id -> GPUs.
            batch: job id -> global batch; jobs absent keep their requested batch.
        """
        gpus = place(counts, self.owner, self.cluster.gpus_per_node)
        batch = batch or {}
        return {j: Assignment(g, int(batch.get(j, self.jobs.req_batch[j])))
                for j, g in gpus.items()}


class Policy(ABC):
    """A cluster scheduling policy, called once per scheduling round.

    Subclasses set ``name`` and implement :meth:`schedule`. A policy that is not ``periodic``
    is only called when jobs arrive or finish (its decisions depend on nothing else).
    """

    name: str = "policy"
    periodic: bool = True

    def reset(self, cluster: ClusterSpec, models: JobModels, seed: int) -> None:
        """Forget all state before a new simulation (override to seed a generator)."""

    @abstractmethod
    def schedule(self, view: ClusterView) -> Schedule:
        """Decide every active job's GPUs and batch size for the coming round.

        Jobs left out of the result are queued (or preempted, if they held GPUs).
        """


def gang_fill(view: ClusterView, order, keep_running: bool = False) -> dict[int, int]:
    """Give jobs their requested GPU count in ``order`` while they fit (backfilling).

    Args:
        view: the cluster view.
        order: job ids in priority order.
        keep_running: if True, jobs holding GPUs keep them first (no preemption).
    """
    free = view.cluster.gpus
    counts: dict[int, int] = {}
    if keep_running:
        for j in view.running():
            counts[int(j)] = int(view.jobs.n[j])
            free -= counts[int(j)]
    for j in order:
        j = int(j)
        want = int(view.jobs.req_gpus[j])
        if j not in counts and want <= free:
            counts[j] = want
            free -= want
    return counts


def grow_by_marginal_gain(counts: dict, free: int, delta: Callable[[Hashable, int], float],
                          limit: Callable[[Hashable], int]) -> dict:
    """Hand out ``free`` GPUs one at a time to the job whose next GPU helps most.

    ``counts`` maps each job to the GPUs it holds (all start at 1); ``delta(j, n)`` is the
    change in the objective from ``n`` to ``n + 1`` GPUs (negative is better); a job never
    exceeds ``limit(j)``. Returns ``counts``, updated in place.
    """
    heap = [(delta(j, counts[j]), j) for j in counts if counts[j] < limit(j)]
    heapq.heapify(heap)
    while free > 0 and heap:
        gain, j = heapq.heappop(heap)
        if gain >= 0:
            break
        counts[j] += 1
        free -= 1
        if counts[j] < limit(j):
            heapq.heappush(heap, (delta(j, counts[j]), j))
    return counts
