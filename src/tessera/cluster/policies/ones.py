"""ONES (SC'21): online evolutionary search over whole-cluster schedules.

Each round the policy keeps a population of K candidate schedules (one job id per GPU; a job's
GPU count sets its batch). It makes K children by uniform per-GPU crossover of K/2 random pairs
(each then mutated with probability ``mutation_rate``) and K mutants (parents with one random
job removed, i.e. preempted), repairs all 3K candidates (:func:`ones_ga.repair`) and keeps the K
fittest. The population survives across rounds, so the search continues online as jobs arrive
(they enter as 1-GPU genes through repair) and finish (their genes become idle). Two seeds join
the population every round: the schedule running now, and a marginal-gain greedy schedule
(:func:`ones_fitness.greedy_counts`).

Batch size (``batching``): "goodput" (default) gives a job on ``n`` GPUs the batch with the best
goodput, throughput x statistical efficiency (:func:`ones_fitness.best_batch`): a larger batch
is worth only what the efficiency model says. "linear" is the artifact's rule: per-GPU batch
fixed, global batch = per-GPU batch x n, capped at the largest batch the LR rule allows.

Fitness (lower is better; ``objective``): "slowdown" (default): the summed predicted completion
time of all jobs, queued ones included (:func:`ones_fitness.completion_sum`), each divided by
the job's one-GPU remaining time, plus ``restart_s`` (weighted alike) for every job whose count
changes; "jct": the same without the division; "gpu_time": the artifact's predicted remaining
GPU-time ``sum_j n_j * remaining_j / goodput_j(n_j)`` plus ``n_j * restart_s``.

Bounds on resizing: a job keeps its GPUs for ``resize_epochs`` epochs after each change (it is
*frozen*: pinned in every candidate); only jobs with ``min_mutate_epochs`` epochs done may be
preempted by mutation; a job never holds more than ``min(cluster, cap_factor x requested)``
GPUs (nor more than its largest batch allows at the smallest per-GPU batch); with
``cap_growth_epochs`` set, its cap starts at 1 and doubles every that many epochs (the
artifact's ramp); a job holding half the cluster and running longer than the median running
job is cut back to ``2n / (run / median + 1)``.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.placement import place
from tessera.cluster.policies import ones_fitness as fit
from tessera.cluster.policies import ones_ga as ga
from tessera.cluster.policies.base import ClusterView, Policy, Schedule

OBJECTIVES = ("slowdown", "jct", "gpu_time")


class ONES(Policy):
    """Online evolutionary scheduler (see the module docstring; docs/scheduler.md says which
    defaults differ from the artifact and why).

    Args:
        population: K, candidates kept between rounds.
        mutation_rate: probability that a child loses one job.
        min_mutate_epochs: epochs a job must have done before mutation may preempt it.
        resize_epochs: epochs a job runs between two changes of its GPUs.
        cap_growth_epochs: epochs between doublings of a job's GPU cap, which starts at 1
            (the artifact: 2.0); None: no ramp.
        cap_factor: a job never gets more than this times the GPUs it requested (artifact: 4).
        generations: generations evolved per scheduling round.
        max_epoch_s: if set, an "epoch" for the epoch-based bounds above is at most the samples
            the job processes in this many seconds on one GPU. The artifact's jobs had epochs
            of seconds to minutes; a full ImageNet epoch is hours on one GPU. None: real epochs.
        charge_queued: objective "gpu_time" only: charge a job that a candidate leaves queued
            its one-GPU remaining GPU-time (False: the literal artifact sum, where it is free).
        objective: "slowdown", "jct" or "gpu_time" (the artifact's), see the module docstring.
        batching: "goodput" or "linear" (the artifact's), see the module docstring.
        greedy_seed: add the marginal-gain greedy schedule to the population every round.
    """

    name = "ones"

    def __init__(self, population: int = 16, mutation_rate: float = 0.3,
                 min_mutate_epochs: float = 2.0, resize_epochs: float = 1.0,
                 cap_growth_epochs: float | None = None, cap_factor: int = 16,
                 generations: int = 1, max_epoch_s: float | None = 60.0,
                 charge_queued: bool = True, objective: str = "slowdown",
                 batching: str = "goodput", greedy_seed: bool = True) -> None:
        if population < 2 or population % 2:
            raise ValueError("population must be an even number >= 2")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{objective!r}")
        if batching not in ("linear", "goodput"):
            raise ValueError(f"batching must be linear or goodput, got {batching!r}")
        if cap_growth_epochs is not None and cap_growth_epochs <= 0:
            raise ValueError(f"cap_growth_epochs must be > 0 or None, got {cap_growth_epochs}")
        self.objective, self.batching, self.greedy_seed = objective, batching, greedy_seed
        self.k, self.mutation_rate = population, mutation_rate
        self.min_mutate_epochs, self.resize_epochs = min_mutate_epochs, resize_epochs
        self.cap_growth_epochs, self.cap_factor = cap_growth_epochs, cap_factor
        self.generations, self.max_epoch_s = generations, max_epoch_s
        self.charge_queued = charge_queued
        self.reset(None, None, 0)

    @classmethod
    def artifact(cls) -> "ONES":
        """ONES as the public artifact implements it (real epochs, 1-GPU start and doubling
        ramp, caps at 4x requested, per-GPU batch fixed, GPU-time fitness, no greedy seed)."""
        return cls(cap_growth_epochs=2.0, cap_factor=4, max_epoch_s=None,
                   objective="gpu_time", batching="linear", greedy_seed=False)

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
        if self.cap_growth_epochs is not None:
            done = self.bound_epochs(view, ids, j.samples[ids])
            limit = np.minimum(limit, 2.0 ** np.minimum(np.floor(done / self.cap_growth_epochs),
                                                        40))
        cap = np.maximum(limit, 1).astype(np.int64)
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

    def fitness(self, view: ClusterView, ids: np.ndarray, pop: np.ndarray,
                t1: np.ndarray | None = None) -> np.ndarray:
        """Each candidate's fitness (lower is better; see the module docstring). ``t1``: the
        jobs' one-GPU remaining times if already known this round."""
        j, jn = view.jobs, len(ids)
        t1 = self._one_gpu_time(view, ids) if t1 is None else t1
        n = ga.counts(pop, jn)
        m = ga.nodes_spanned(pop, jn, view.cluster.gpus_per_node)
        rate, _ = self.rates(view, ids, n, m)
        rem = view.remaining(ids)[None, :]
        changed = (n > 0) & (n != j.n[ids][None, :])
        t = rem / np.maximum(rate, 1e-30)
        if self.objective != "gpu_time":
            w = self._weight(t1)
            return fit.completion_sum(t, n, pop, t1, w) + (changed * view.restart_s * w).sum(axis=1)
        gpu_time = np.where(n > 0, n * t, 0.0)
        if self.charge_queued:
            # n * rem / thr(n) is 0 * inf for a queued job; it still has to run, at least on
            # one GPU, so it is charged that, else preempting would look free.
            gpu_time = np.where(n > 0, gpu_time, t1[None, :])
        return (gpu_time + changed * n * view.restart_s).sum(axis=1)

    def rates(self, view: ClusterView, ids: np.ndarray, n: np.ndarray,
              m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(goodput, global batch) of each job under each candidate; n, m: (C, J) counts and
        nodes spanned. A job whose count is unchanged keeps its running batch (changing it
        alone would cost a restart)."""
        j = view.jobs
        if self.batching == "linear":
            b = self.batch(view, ids[None, :], n)
            frac = j.fraction(ids)[None, :]
            return view.models.goodput(j.app[ids][None, :], n, np.maximum(m, 1), b, frac), b
        rate, batch = np.zeros(n.shape), np.zeros(n.shape)
        on = n > 0
        local = np.broadcast_to(np.arange(n.shape[1]), n.shape)[on]
        key = (local * (view.cluster.gpus + 1) + n[on]) * (view.cluster.nodes + 1) + m[on]
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        good, b = self.choose_batch(view, ids[local[first]], n[on][first], m[on][first])
        rate[on], batch[on] = good[inv.ravel()], b[inv.ravel()]
        return rate, batch

    def choose_batch(self, view: ClusterView, ids: np.ndarray, n: np.ndarray,
                     nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(goodput, batch) per entry for ``batching="goodput"``: the best batch, except that
        a running job asked for its current count keeps its batch."""
        j = view.jobs
        nodes = np.maximum(nodes, 1)
        good, b = fit.best_batch(view, ids, n, nodes)
        keep = n == j.n[ids]
        cur = view.models.goodput(j.app[ids], n, nodes, j.batch[ids], j.fraction(ids))
        return np.where(keep, cur, good), np.where(keep, j.batch[ids], b)

    def _weight(self, t1: np.ndarray) -> np.ndarray:
        """Per-job weight of completion time: 1, or for "slowdown" 1 / one-GPU remaining time,
        so that a minute saved on a short job counts more than one on a long job (as in
        shortest-remaining-time-first, which minimises average completion time)."""
        if self.objective != "slowdown":
            return np.ones_like(t1)
        return 1.0 / np.maximum(t1, 1.0)

    def _one_gpu_time(self, view: ClusterView, ids: np.ndarray) -> np.ndarray:
        if self.batching == "linear":
            return view.predicted_time(ids, 1, self.batch(view, ids, 1))
        one = np.ones(len(ids), dtype=np.int64)
        good, _ = fit.best_batch(view, ids, one, one)
        return view.remaining(ids) / np.maximum(good, 1e-30)

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
        t1 = self._one_gpu_time(view, ids)
        movable = np.flatnonzero(~frozen)
        fill = movable[np.lexsort((movable, t1[movable]))]
        mutable = ~frozen & (self.bound_epochs(view, ids, j.samples[ids]) >= self.min_mutate_epochs)
        pop = (np.tile(current, (self.k, 1)) if self.pop is None
               else np.where(self.pop >= 0, loc[np.maximum(self.pop, 0)], -1))
        pop[0] = current  # keeping today's schedule is always a candidate
        if self.greedy_seed:
            pop[1] = self._greedy(view, ids, t1, cap, np.where(frozen, j.n[ids], -1))
        for _ in range(self.generations):
            kids = ga.remove_random_job(ga.crossover(pop, self.rng), mutable,
                                        self.mutation_rate, self.rng)
            mutants = ga.remove_random_job(pop, mutable, 1.0, self.rng)
            cand = ga.repair(np.concatenate([pop, kids, mutants]), current, frozen, cap, new,
                             fill)
            pop = cand[np.argsort(self.fitness(view, ids, cand, t1), kind="stable")[: self.k]]
        self.pop = np.where(pop >= 0, ids[np.maximum(pop, 0)], -1)
        return self._emit(view, ids, ga.counts(pop[:1], jn)[0])

    def _greedy(self, view: ClusterView, ids: np.ndarray, t1: np.ndarray, cap: np.ndarray,
                fixed: np.ndarray) -> np.ndarray:
        """The marginal-gain greedy's counts as a candidate (local ids per GPU), placed so that
        jobs keep their current GPUs."""
        counts = fit.greedy_counts(view, ids, t1, cap, fixed, self._weight(t1))
        live = np.flatnonzero(counts)
        gpus = place({int(ids[i]): int(counts[i]) for i in live}, view.owner,
                     view.cluster.gpus_per_node)
        row = np.full(view.cluster.gpus, -1, dtype=np.int64)
        loc = dict(zip(ids[live].tolist(), live.tolist()))
        for job, g in gpus.items():
            row[g] = loc[job]
        return row

    def _emit(self, view: ClusterView, ids: np.ndarray, n: np.ndarray) -> Schedule:
        if self.batching == "linear":
            b = self.batch(view, ids, n)
        else:
            b = np.zeros(len(ids))
            on = n > 0
            packed = np.ceil(n[on] / view.cluster.gpus_per_node)
            b[on] = self.choose_batch(view, ids[on], n[on], packed)[1]
        counts = {int(ids[i]): int(n[i]) for i in np.flatnonzero(n)}
        batch = {int(ids[i]): int(b[i]) for i in np.flatnonzero(n)}
        out = view.place(counts, batch)
        if self.pop is not None:  # the applied placement becomes the elite candidate
            self.pop[0] = -1
            for job, a in out.items():
                self.pop[0][a.gpus] = job
        return out
