"""ONES (SC'21): online evolutionary search over whole-cluster schedules.

Each round the policy keeps a population of K candidate schedules (one job id per GPU; a job's
GPU count sets its batch: per-GPU batch fixed, global batch = per-GPU batch x GPUs, capped at
the largest batch the learning-rate rule allows). It makes K children by uniform per-GPU
crossover of K/2 random pairs (each then mutated with probability ``mutation_rate``) and K
mutants (parents with one random job removed, i.e. preempted), repairs all 3K candidates
(:func:`repair`) and keeps the K fittest. Fitness (lower is better) is the predicted remaining
GPU-time ``sum_j n_j * remaining_j / goodput_j(n_j)`` plus ``n_j * restart_s`` for every job whose
count changes. The population survives across rounds, so the search continues online as jobs
arrive (they enter as 1-GPU genes through repair) and finish (their genes become idle).

Bounds on resizing: a job keeps its GPUs for ``resize_epochs`` epochs after each change (it is
*frozen*: pinned in every candidate); only jobs with ``min_mutate_epochs`` epochs done may be
preempted by mutation; a job's GPU cap starts at 1 and doubles every ``cap_growth_epochs`` epochs
up to ``min(cluster, cap_factor x requested)``; a job holding half the cluster and running longer
than the median running job is cut back to ``2n / (run / median + 1)``.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies import ones_ga as ga
from tessera.cluster.policies.base import ClusterView, Policy, Schedule


class ONES(Policy):
    """Online evolutionary scheduler (see the module docstring).

    Args:
        population: K, candidates kept between rounds.
        mutation_rate: probability that a child loses one job.
        min_mutate_epochs: epochs a job must have done before mutation may preempt it.
        resize_epochs: epochs a job runs between two changes of its GPUs.
        cap_growth_epochs: epochs between doublings of a job's GPU cap.
        cap_factor: a job never gets more than this times the GPUs it requested.
        generations: generations evolved per scheduling round.
        max_epoch_s: if set, an "epoch" for the three epoch-based bounds above is at most the
            samples the job processes in this many seconds on one GPU. The artifact's jobs had
            epochs of seconds to minutes; with full ImageNet or BERT epochs (hours on one GPU)
            the epoch-based ramp keeps jobs small for most of their life. None = real epochs.
        charge_queued: charge a job that a candidate leaves queued its one-GPU remaining
            GPU-time (False: it costs nothing, the literal reading of the artifact's sum).
        objective: "gpu_time" (the artifact's fitness, predicted remaining GPU-time) or "jct"
            (predicted remaining completion time summed over jobs: ``remaining / goodput``
            for a placed job; for a queued one, the shortest placed job's remaining time — when
            GPUs free up at the earliest — plus its own one-GPU time). Minimising GPU-time
            favours small allocations, which is not what average JCT rewards; see
            docs/scheduler.md.
    """

    name = "ones"

    def __init__(self, population: int = 16, mutation_rate: float = 0.3,
                 min_mutate_epochs: float = 2.0, resize_epochs: float = 1.0,
                 cap_growth_epochs: float = 2.0, cap_factor: int = 4,
                 generations: int = 1, max_epoch_s: float | None = None,
                 charge_queued: bool = True, objective: str = "gpu_time") -> None:
        if population < 2 or population % 2:
            raise ValueError("population must be an even number >= 2")
        if objective not in ("gpu_time", "jct"):
            raise ValueError(f"objective must be gpu_time or jct, got {objective!r}")
        self.objective = objective
        self.k, self.mutation_rate = population, mutation_rate
        self.min_mutate_epochs, self.resize_epochs = min_mutate_epochs, resize_epochs
        self.cap_growth_epochs, self.cap_factor = cap_growth_epochs, cap_factor
        self.generations, self.max_epoch_s = generations, max_epoch_s
        self.charge_queued = charge_queued
        self.reset(None, None, 0)

    def reset(self, cluster, models, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pop: np.ndarray | None = None  # (K, G) global job ids, -1 idle

    # ------------------------------------------------------------------------ helpers
    def bound_epochs(self, view: ClusterView, ids: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """``samples`` expressed in the epochs the resize bounds count in."""
        size = view.jobs.epoch_samples[ids]
        if self.max_epoch_s is not None:
            j = view.jobs
            one = view.models.throughput(j.app[ids], 1, 1, self.batch(view, ids, 1))
            size = np.minimum(size, one * self.max_epoch_s)
        return samples / size

    def caps(self, view: ClusterView, ids: np.ndarray) -> np.ndarray:
        """Current GPU cap of each job in ``ids``."""
        j, g = view.jobs, view.cluster.gpus
        min_local = view.models.param("min_local", j.app[ids])
        by_batch = np.floor(view.models.param("max_batch", j.app[ids]) / min_local)
        limit = np.minimum(np.minimum(g, self.cap_factor * j.req_gpus[ids]), by_batch)
        steps = np.floor(self.bound_epochs(view, ids, j.samples[ids]) / self.cap_growth_epochs)
        grown = 2.0 ** np.minimum(steps, 40)
        cap = np.maximum(np.minimum(limit, grown), 1).astype(np.int64)
        run = j.n[ids] > 0
        if run.sum() >= 2:
            age = view.time - np.nan_to_num(j.first_start[ids], nan=view.time)
            med = float(np.median(age[run]))
            big = int(np.argmax(np.where(run, j.n[ids], -1)))
            n_big = int(j.n[ids][big])
            if n_big >= g / 2 and med > 0 and age[big] > med:
                cap[big] = min(cap[big], max(1, int(2 * n_big / (age[big] / med + 1))))
        return cap

    def batch(self, view: ClusterView, ids, n) -> np.ndarray:
        """Global batch at ``n`` GPUs: per-GPU batch fixed, capped by the LR rule."""
        j = view.jobs
        bmax = view.models.param("max_batch", j.app[ids])
        return np.maximum(np.minimum(np.round(j.local0[ids] * n), bmax), 1)

    def fitness(self, view: ClusterView, ids: np.ndarray, pop: np.ndarray) -> np.ndarray:
        """Predicted remaining GPU-seconds (completion seconds for objective="jct") of each
        candidate (lower is better)."""
        j, jn = view.jobs, len(ids)
        n = ga.counts(pop, jn)
        m = ga.nodes_spanned(pop, jn, view.cluster.gpus_per_node)
        b = self.batch(view, ids[None, :], n)
        rate = view.models.goodput(j.app[ids][None, :], n, np.maximum(m, 1), b,
                                   j.fraction(ids)[None, :])
        rem = view.remaining(ids)[None, :]
        changed = (n > 0) & (n != j.n[ids][None, :])
        if self.objective == "jct":
            return self._jct(view, ids, n, rem / np.maximum(rate, 1e-30), changed)
        gpu_time = np.where(n > 0, n * rem / np.maximum(rate, 1e-30), 0.0)
        if self.charge_queued:
            # n * rem / thr(n) is 0 * inf for a queued job; it still has to run, at least on
            # one GPU, so it is charged that, else preempting would look free.
            one = self._one_gpu_time(view, ids)[None, :]
            gpu_time = np.where(n > 0, gpu_time, one)
        return (gpu_time + changed * n * view.restart_s).sum(axis=1)

    def _jct(self, view: ClusterView, ids: np.ndarray, n: np.ndarray, t: np.ndarray,
             changed: np.ndarray) -> np.ndarray:
        """Summed predicted remaining completion time of each candidate (objective="jct")."""
        placed = np.where(n > 0, t, np.inf)
        # A queued job waits at least until the first placed job finishes, then runs.
        wait = placed.min(axis=1, keepdims=True)
        wait = np.where(np.isfinite(wait), wait, 0.0)
        total = np.where(n > 0, t, wait + self._one_gpu_time(view, ids)[None, :])
        return (total + changed * view.restart_s).sum(axis=1)

    def _one_gpu_time(self, view: ClusterView, ids: np.ndarray) -> np.ndarray:
        return view.predicted_time(ids, 1, self.batch(view, ids, 1))

    # ------------------------------------------------------------------------ the round
    def schedule(self, view: ClusterView) -> Schedule:
        j, ids = view.jobs, view.active
        jn = len(ids)
        loc = np.full(len(j), -1, dtype=np.int64)
        loc[ids] = np.arange(jn)
        current = np.where(view.owner >= 0, loc[np.maximum(view.owner, 0)], -1)
        running = j.n[ids] > 0
        frozen = running & (self.bound_epochs(view, ids, j.since_change[ids]) < self.resize_epochs)
        idle = int((current < 0).sum())
        if not view.changed and not (running & ~frozen).any() and (idle == 0 or running.all()):
            return self._emit(view, ids, ga.counts(current[None], jn)[0])
        cap = self.caps(view, ids)
        new = np.flatnonzero((j.samples[ids] == 0) & ~running)
        t1 = view.predicted_time(ids, 1, self.batch(view, ids, 1))
        movable = np.flatnonzero(~frozen)
        fill = movable[np.lexsort((movable, t1[movable]))]
        mutable = ~frozen & (self.bound_epochs(view, ids, j.samples[ids]) >= self.min_mutate_epochs)
        pop = (np.tile(current, (self.k, 1)) if self.pop is None
               else np.where(self.pop >= 0, loc[np.maximum(self.pop, 0)], -1))
        pop[0] = current  # keeping today's schedule is always a candidate
        for _ in range(self.generations):
            kids = ga.remove_random_job(ga.crossover(pop, self.rng), mutable,
                                        self.mutation_rate, self.rng)
            mutants = ga.remove_random_job(pop, mutable, 1.0, self.rng)
            cand = ga.repair(np.concatenate([pop, kids, mutants]), current, frozen, cap, new,
                             fill)
            pop = cand[np.argsort(self.fitness(view, ids, cand), kind="stable")[: self.k]]
        self.pop = np.where(pop >= 0, ids[np.maximum(pop, 0)], -1)
        return self._emit(view, ids, ga.counts(pop[:1], jn)[0])

    def _emit(self, view: ClusterView, ids: np.ndarray, n: np.ndarray) -> Schedule:
        b = self.batch(view, ids, n)
        counts = {int(ids[i]): int(n[i]) for i in np.flatnonzero(n)}
        batch = {int(ids[i]): int(b[i]) for i in np.flatnonzero(n)}
        out = view.place(counts, batch)
        if self.pop is not None:  # the applied placement becomes the elite candidate
            self.pop[0] = -1
            for job, a in out.items():
                self.pop[0][a.gpus] = job
        return out
