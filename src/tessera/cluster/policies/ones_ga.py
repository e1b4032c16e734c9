"""Vectorised genetic operators for ONES over a population of cluster schedules.

A candidate schedule is an array with one slot per GPU holding a *local* job index (0..J-1 over
the active jobs) or -1 for an idle GPU; a population is a (C, G) array of them. All operators
work on the whole population at once.
"""

from __future__ import annotations

import numpy as np


def counts(pop: np.ndarray, n_jobs: int) -> np.ndarray:
    """(C, J) GPUs each candidate gives each job."""
    c = pop.shape[0]
    held = pop >= 0
    key = (np.arange(c)[:, None] * n_jobs + pop)[held]
    return np.bincount(key, minlength=c * n_jobs).reshape(c, n_jobs)


def nodes_spanned(pop: np.ndarray, n_jobs: int, gpus_per_node: int) -> np.ndarray:
    """(C, J) distinct nodes each candidate spreads each job over."""
    c, g = pop.shape
    x = pop.reshape(c, g // gpus_per_node, gpus_per_node)
    first = x >= 0
    for k in range(1, gpus_per_node):  # a slot counts if no earlier slot of its node has its job
        for i in range(k):
            first[:, :, k] &= x[:, :, k] != x[:, :, i]
    key = (np.arange(c)[:, None, None] * n_jobs + x)[first]
    return np.bincount(key, minlength=c * n_jobs).reshape(c, n_jobs)


def crossover(parents: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Uniform per-slot crossover of K/2 random pairs; returns K children."""
    k = parents.shape[0]
    perm = rng.permutation(k)
    a, b = parents[perm[0::2]], parents[perm[1::2][: len(perm[0::2])]]
    if len(b) < len(a):
        b = np.concatenate([b, parents[perm[:1]]])
    mask = rng.random(a.shape) < 0.5
    return np.concatenate([np.where(mask, a, b), np.where(mask, b, a)])


def remove_random_job(pop: np.ndarray, mutable: np.ndarray, rate: float,
                      rng: np.random.Generator) -> np.ndarray:
    """With probability ``rate`` per candidate, drop one random mutable job it runs.

    Args:
        pop: (C, G) candidates (modified copy returned).
        mutable: (J,) bool, jobs that may be preempted.
        rate: per-candidate mutation probability.
        rng: generator.
    """
    c = pop.shape[0]
    hit = rng.random(c) < rate
    eligible = (counts(pop, mutable.size) > 0) & mutable[None, :]
    # A uniform choice among each row's eligible jobs: the largest of i.i.d. uniform keys.
    keys = np.where(eligible, rng.random(eligible.shape), -1.0)
    pick = keys.argmax(axis=1) if mutable.size else np.zeros(c, dtype=np.int64)
    apply = hit & (keys.max(axis=1, initial=-1.0) >= 0)
    out = pop.copy()
    out[(out == pick[:, None]) & apply[:, None]] = -1
    return out


def _rank_in_group(key: np.ndarray) -> np.ndarray:
    """0-based rank of each element among equal keys, in original order."""
    order = np.argsort(key, kind="stable")
    sk = key[order]
    start = np.r_[0, np.flatnonzero(sk[1:] != sk[:-1]) + 1]
    rank_sorted = np.arange(len(key)) - np.repeat(start, np.diff(np.r_[start, len(key)]))
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def repair(pop: np.ndarray, current: np.ndarray, frozen: np.ndarray, cap: np.ndarray,
           new_jobs: np.ndarray, fill_order: np.ndarray) -> np.ndarray:
    """Make every candidate feasible and work-conserving.

    1. Frozen jobs (resized too recently) hold exactly their current GPUs.
    2. No job holds more than its cap (surplus slots, last ones first, become idle).
    3. Idle GPUs go first to new jobs not yet placed, one each (in the given order), then to
       the jobs in ``fill_order`` (shortest predicted remaining time first), up to their caps.

    Args:
        pop: (C, G) candidates (a repaired copy is returned).
        current: (G,) the schedule running now, same encoding.
        frozen: (J,) bool.
        cap: (J,) maximum GPUs per job.
        new_jobs: local ids of never-started jobs, in arrival order.
        fill_order: local ids of non-frozen jobs, in fill priority order.
    """
    pop = pop.copy()
    c, g = pop.shape
    j = cap.size
    pinned = (current >= 0) & frozen[np.maximum(current, 0)]
    held = pop >= 0
    pop[held & frozen[np.maximum(pop, 0)]] = -1
    pop[:, pinned] = current[pinned]
    n = counts(pop, j)
    excess = n > cap[None, :]
    if excess.any():  # only slots of over-cap jobs need ranking (rare: after crossover)
        rows, cols = np.nonzero((pop >= 0) & excess[np.arange(c)[:, None], np.maximum(pop, 0)])
        jobs_over = pop[rows, cols]
        rank = _rank_in_group(rows * j + jobs_over)
        drop = rank >= cap[jobs_over]
        pop[rows[drop], cols[drop]] = -1
        n = counts(pop, j)
    idle = g - n.sum(axis=1)
    g1 = np.zeros((c, new_jobs.size), dtype=np.int64)
    if new_jobs.size:
        d1 = (n[:, new_jobs] == 0).astype(np.int64)
        g1 = _grant(d1, idle)
        idle = idle - g1.sum(axis=1)
        n[:, new_jobs] += g1
    d2 = np.maximum(cap[fill_order][None, :] - n[:, fill_order], 0)
    g2 = _grant(d2, idle)
    jobs_seq = np.concatenate([new_jobs, fill_order])
    grants = np.concatenate([g1, g2], axis=1)
    fill = np.repeat(np.tile(jobs_seq, c), grants.ravel())
    free = pop < 0
    take = free & (np.cumsum(free, axis=1) <= grants.sum(axis=1)[:, None])
    pop[take] = fill  # row-major order matches the candidate-major order of ``fill``
    return pop


def _grant(demand: np.ndarray, supply: np.ndarray) -> np.ndarray:
    """Serve ``demand`` (C, M) left to right from ``supply`` (C,)."""
    before = np.cumsum(demand, axis=1) - demand
    return np.clip(supply[:, None] - before, 0, demand)
