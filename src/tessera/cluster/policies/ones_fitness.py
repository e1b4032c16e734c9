"""ONES's batch-size choice, completion-time fitness and greedy seed, vectorised.

* :func:`best_batch`: the global batch a job should use on ``n`` GPUs: the one with the highest
  goodput (throughput x statistical efficiency) on a log grid between the base batch (at least
  the smallest profiled per-GPU batch) and the largest batch the learning-rate rule allows. A
  larger batch is only worth it as far as goodput says.
* :func:`completion_sum`: the summed predicted completion time of every active job under each
  candidate: a placed job finishes at ``remaining / goodput(n)``; a queued job waits for a GPU
  to free up (GPUs free when the jobs holding them finish; queued jobs take them shortest
  first, one GPU each, then run at their one-GPU time).
* :func:`greedy_counts`: every job one GPU (shortest first while GPUs last), then the remaining
  GPUs one at a time to the job whose predicted time drops most (up to its cap): the seed
  candidate of the population.
"""

from __future__ import annotations

import numpy as np

from tessera.cluster.policies.base import ClusterView

BATCH_STEPS = 12  # log-spaced candidate batches per (job, GPU count)


def best_batch(view: ClusterView, ids: np.ndarray, n: np.ndarray,
               nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(goodput, batch) of the best batch for jobs ``ids`` on ``n`` GPUs over ``nodes`` nodes.

    All three arrays have the same shape (P,); ``n`` >= 1.
    """
    j, models = view.jobs, view.models
    app = j.app[ids]
    # The batch grid and throughput depend on (app, n, nodes) only, not on the job: compute
    # them once per distinct triple (a round asks for thousands of rows, a few distinct).
    code = (app.astype(np.int64) * (view.cluster.gpus + 1)
            + np.asarray(n, dtype=np.int64)) * (view.cluster.gpus + 1) + np.asarray(
                nodes, dtype=np.int64)
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    b, thr = _grid(models, app[first], np.asarray(n)[first], np.asarray(nodes)[first])
    b, thr = b[inverse], thr[inverse]  # (P, S)
    good = thr * models.efficiency(app[:, None], b, j.fraction(ids)[:, None])
    pick = good.argmax(axis=1)
    rows = np.arange(len(ids))
    return good[rows, pick], b[rows, pick]


def _grid(models, app: np.ndarray, n: np.ndarray, nodes: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """(batch, throughput), each (U, S): the log grid of candidate batches between the base
    batch (at least the smallest profiled per-GPU batch) and the largest allowed, and the
    throughput of each on ``n`` GPUs over ``nodes`` nodes."""
    b0, bmax = models.param("base_batch", app), models.param("max_batch", app)
    lo = np.minimum(np.maximum(b0, np.ceil(models.param("min_local", app) * n)), bmax)
    steps = np.linspace(0.0, 1.0, BATCH_STEPS)[None, :]
    b = np.round(lo[:, None] * (bmax / lo)[:, None] ** steps)
    return b, models.throughput(app[:, None], n[:, None], nodes[:, None], b)


def completion_sum(t: np.ndarray, n: np.ndarray, pop: np.ndarray, t1: np.ndarray,
                   weight: np.ndarray) -> np.ndarray:
    """Summed predicted completion time of each candidate.

    Args:
        t: (C, J) predicted seconds to finish of placed jobs (ignored where ``n`` is 0).
        n: (C, J) GPUs per job.
        pop: (C, G) candidates (local job index per GPU, -1 idle).
        t1: (J,) predicted seconds on one GPU (what a queued job runs at once started).
        weight: (J,) weight of each job's completion time.
    """
    c, jn = n.shape
    placed = n > 0
    # When each GPU frees up: its job's finish time; an idle GPU is not counted as free (a
    # candidate that idles GPUs while jobs queue should not look better for it).
    slot_t = np.where(pop >= 0, np.take_along_axis(t, np.maximum(pop, 0), axis=1), np.inf)
    free_at = np.sort(slot_t, axis=1)  # (C, G)
    used = np.maximum((pop >= 0).sum(axis=1), 1)
    queued = ~placed
    order = np.argsort(t1, kind="stable")
    # Each row's queued jobs first, shortest first: (C, J) local job ids.
    ranked = order[np.argsort(~queued[:, order], axis=1, kind="stable")]
    nq = queued.sum(axis=1)
    rank = np.arange(jn)[None, :]
    t1r = t1[ranked]
    lane = np.minimum(rank, used[:, None] - 1)
    first = rank < used[:, None]
    wait = np.where(first, np.take_along_axis(free_at, np.minimum(lane, free_at.shape[1] - 1),
                                              axis=1), 0.0)
    wait = np.where(np.isfinite(wait), wait, 0.0)
    fin = np.where(first, wait + t1r, 0.0)
    # Later queued jobs take the GPU of the job ``used`` places before them when it finishes.
    for k in range(1, int(np.ceil(nq.max(initial=0) / used.min())) + 1):
        band = (rank >= k * used[:, None]) & (rank < (k + 1) * used[:, None])
        if not band.any():
            break
        prev = np.take_along_axis(fin, np.maximum(rank - used[:, None], 0), axis=1)
        fin = np.where(band, prev + t1r, fin)
    queued_sum = np.where(rank < nq[:, None], fin * weight[ranked], 0.0).sum(axis=1)
    return np.where(placed, t * weight[None, :], 0.0).sum(axis=1) + queued_sum


def greedy_counts(view: ClusterView, ids: np.ndarray, t1: np.ndarray, cap: np.ndarray,
                  fixed: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """(J,) GPU counts: marginal-gain greedy on predicted completion time.

    Args:
        view: the cluster view.
        ids: active job ids.
        t1: (J,) predicted seconds on one GPU.
        cap: (J,) GPU cap per job.
        fixed: (J,) counts of jobs that must keep their GPUs (-1: free to choose).
        weight: (J,) weight of each job's completion time.
    """
    g, gpn = view.cluster.gpus, view.cluster.gpus_per_node
    counts = np.where(fixed >= 0, fixed, 0)
    free = g - int(counts.sum())
    cand = np.flatnonzero(fixed < 0)
    cand = cand[np.lexsort((cand, t1[cand]))][: max(free, 0)]
    counts[cand] = 1
    free -= cand.size
    top = int(min(cap[cand].max(initial=1), free + 1))
    if free <= 0 or top <= 1:
        return counts
    # Predicted time at 1..top GPUs (packed), best batch; gains of each extra GPU.
    nn = np.arange(1, top + 1)
    jj = np.repeat(cand, top)
    n_flat = np.tile(nn, cand.size)
    # Only counts within a job's cap are priced: the gains towards counts above it are masked
    # below, and the running minimum only carries values rightwards, so those rows never matter.
    live = n_flat <= np.repeat(cap[cand], top)
    good = np.ones(n_flat.shape)
    good[live], _ = best_batch(view, ids[jj[live]], n_flat[live], np.ceil(n_flat[live] / gpn))
    rem = view.remaining(ids[jj])
    t = (rem / np.maximum(good, 1e-30)).reshape(cand.size, top)
    gain = (t[:, :-1] - t[:, 1:]) * weight[cand][:, None]  # (Jc, top-1): from n to n+1 GPUs
    # Concave: an extra GPU never gains more than the one before (keeps the greedy consistent).
    gain = np.minimum.accumulate(gain, axis=1)
    gain[nn[None, 1:] > cap[cand][:, None]] = -np.inf
    flat = gain.ravel()
    best = np.argsort(-flat, kind="stable")[:free]
    best = best[flat[best] > 0]
    np.add.at(counts, cand[best // (top - 1)], 1)
    return counts
