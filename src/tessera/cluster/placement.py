"""Turning per-job GPU counts into concrete GPUs, moving as few jobs as possible.

Each job keeps as many of its current GPUs as its new count allows (those on the nodes where it
has the most). Jobs that need more take free GPUs on their own nodes first, then whole free
nodes, then the node whose free GPUs fit the need most tightly (best fit), which keeps jobs on
few nodes and leaves whole nodes for large jobs.
"""

from __future__ import annotations

import numpy as np


def gpus_by_job(owner: np.ndarray) -> dict[int, np.ndarray]:
    """The GPU ids each job holds, from an owner array (job id per GPU, -1 free)."""
    held = np.flatnonzero(owner >= 0)
    if held.size == 0:
        return {}
    order = held[np.argsort(owner[held], kind="stable")]
    jobs, starts = np.unique(owner[order], return_index=True)
    return {int(j): g for j, g in zip(jobs, np.split(order, starts[1:]))}


def _keep(cur: np.ndarray, count: int, gpus_per_node: int) -> np.ndarray:
    if count >= len(cur):
        return cur
    node = cur // gpus_per_node
    per_node = np.bincount(node)[node]
    return np.sort(cur[np.lexsort((cur, -per_node))[:count]])


def _take(free: np.ndarray, node_free: np.ndarray, want: int, home: np.ndarray,
          gpus_per_node: int) -> list[np.ndarray]:
    taken = []

    def grab(node: int, k: int) -> None:
        slots = np.flatnonzero(free[node * gpus_per_node:(node + 1) * gpus_per_node])[:k]
        slots = slots + node * gpus_per_node
        free[slots] = False
        node_free[node] -= len(slots)
        taken.append(slots)

    for node in np.unique(home):
        if want <= 0:
            break
        k = min(want, int(node_free[node]))
        if k:
            grab(int(node), k)
            want -= k
    while want > 0:
        if want >= gpus_per_node and (node_free == gpus_per_node).any():
            node = int(np.argmax(node_free == gpus_per_node))
        else:
            fits = np.flatnonzero(node_free >= want)
            node = (int(fits[np.argmin(node_free[fits])]) if fits.size
                    else int(np.argmax(node_free)))
        k = min(want, int(node_free[node]))
        if k <= 0:
            raise ValueError("not enough free GPUs for the requested counts")
        grab(node, k)
        want -= k
    return taken


def place(counts: dict[int, int], owner: np.ndarray, gpus_per_node: int) -> dict[int, np.ndarray]:
    """Concrete GPUs for the wanted counts, keeping current GPUs where possible.

    Args:
        counts: job id -> GPUs wanted (jobs absent or with 0 get none).
        owner: current owner of each GPU (job id or -1).
        gpus_per_node: GPUs per node.

    Returns:
        job id -> sorted GPU ids, for every job with a positive count.

    Raises:
        ValueError: the counts add up to more GPUs than the cluster has.
    """
    total = owner.size
    if sum(counts.values()) > total:
        raise ValueError(f"counts ask for {sum(counts.values())} GPUs, cluster has {total}")
    current = gpus_by_job(owner)
    free = np.ones(total, dtype=bool)
    out: dict[int, np.ndarray] = {}
    for job, c in counts.items():
        if c > 0 and job in current:
            out[job] = _keep(current[job], c, gpus_per_node)
            free[out[job]] = False
    node_free = free.reshape(-1, gpus_per_node).sum(axis=1)
    growing = sorted((j for j, c in counts.items() if c > len(out.get(j, ()))),
                     key=lambda j: (-(counts[j] - len(out.get(j, ()))), j))
    for job in growing:
        have = out.get(job, np.empty(0, dtype=np.int64))
        extra = _take(free, node_free, counts[job] - len(have), have // gpus_per_node,
                      gpus_per_node)
        out[job] = np.sort(np.concatenate([have, *extra]))
    return out


def nodes_spanned(gpus: np.ndarray, gpus_per_node: int) -> int:
    """Number of distinct nodes among ``gpus``."""
    return len(np.unique(np.asarray(gpus) // gpus_per_node))
