"""Collectives between accelerators for ``tessera profile`` on GPUs: one process per device,
timed on the devices (every timed loop ends with a device synchronise), inside a node and
across nodes.

Unlike CPU workers (``profile_comm.py``), GPUs do not share cores, so each collective is timed
alone, as NCCL's own benchmarks do, every group of a size at once (as a training step runs
them), and fitted as latency + bytes / bandwidth per group size. Groups inside a node are
consecutive local ranks (the planner's tensor-parallel groups are the most local); a
cross-node group holds the devices of one local rank on every node (a multi-node
data-parallel group). Two more figures: how much of an all_reduce hides under a matmul
running at the same time (NCCL runs on its own stream), and how much of an asynchronous
send/recv ring step does (ring attention's overlap).

The same code runs CPU processes over gloo (``device_type="cpu"``): the tests run it that
way, with two "nodes" of two processes, which checks all but the CUDA calls themselves.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from tessera.planner.cluster import COLLECTIVES, CollectiveFit
from tessera.planner.profile_comm import _free_port, collective_fn, fit_latency_bandwidth

# Measured across nodes: what the planner's cross-node groups run (data-parallel gradients,
# pipeline sends); all_to_all and the ring step stay inside a node in tessera's layouts.
CROSS_NODE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class LinkSizes:
    """What the link measurement moves.

    Attributes:
        messages: bytes per device of each timed collective.
        overlap_elements: fp32 elements of the all_reduce timed against a matmul.
        matmul_dim: the square matmul run beside it.
        ring_elements: fp32 elements of the ring step timed against that matmul.
    """

    messages: tuple[int, ...]
    overlap_elements: int
    matmul_dim: int
    ring_elements: int


# NCCL's latency regime starts below 64 KiB and its bandwidth regime above a few MiB; 1 GiB
# per device fits any GPU tessera plans for.
GPU_QUICK = LinkSizes(tuple(2**p for p in range(16, 29, 3)), 1 << 26, 8192, 1 << 22)
GPU_FULL = LinkSizes(tuple(2**p for p in range(12, 31, 2)), 1 << 26, 8192, 1 << 22)


@dataclass(frozen=True)
class LinkFigures:
    """What :func:`measure_links` found.

    Attributes:
        intra: fits inside a node, ``{op: {group size: fit}}``.
        cross: fits of a group with one device per node, ``{op: fit}``; empty for one node.
        nodes: nodes measured; ``cross`` fits are for a group of this size.
        overlap: fraction of an all_reduce hidden under a concurrent matmul.
        ring_overlap: the same for an asynchronous send/recv ring step.
    """

    intra: Mapping[str, Mapping[int, CollectiveFit]]
    cross: Mapping[str, CollectiveFit]
    nodes: int
    overlap: float
    ring_overlap: float


def node_group_sizes(local_world: int) -> list[int]:
    """Group sizes measured inside a node: the powers of two dividing it, and the node."""
    return sorted({g for g in (2, 4, 8, 16) if g < local_world and local_world % g == 0}
                  | ({local_world} if local_world > 1 else set()))


def device_sync(device: torch.device) -> Callable[[], None]:
    """A call that waits until ``device`` has finished its queued work (no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _max_over_ranks(dist, value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_on_devices(dist, fn: Callable[[], object] | None, sync: Callable[[], None],
                     device: torch.device, calls: int, repeats: int = 5) -> float:
    """Seconds per call of ``fn``, from ``calls`` calls started together on every rank and
    ended by a device synchronise: the median of ``repeats`` loops, the slowest rank's (a
    collective ends when its last member does). Every rank must call, ``fn`` None on a
    rank without a part (it still joins the barriers)."""
    if fn is not None:
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        start = time.perf_counter()
        if fn is not None:
            for _ in range(calls):
                fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return _max_over_ranks(dist, statistics.median(samples), device)


def _partition(dist, rank: int, groups: list[list[int]]):
    """Create every group (every rank must) and return this rank's group and members."""
    handles = [dist.new_group(members) for members in groups]
    index = next(i for i, members in enumerate(groups) if rank in members)
    return handles[index], groups[index]


def _time_ops(dist, ops, sizes: tuple[int, ...], rank: int, group, members: list[int],
              device: torch.device, sync) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) per op over ``sizes``; p2p is one message one way (the exchange of
    a pair sends one each way, one after the other)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for nbytes in sizes:
        for op in ops:
            fn = collective_fn(dist, op, nbytes // 4, rank, group, members, device)
            calls = 20 if nbytes <= 1 << 20 else 5
            t = timed_on_devices(dist, fn, sync, device, calls)
            points.setdefault(op, []).append((nbytes, t / 2 if op == "p2p" else t))
    return points


def _overlap(dist, device: torch.device, sync, sizes: LinkSizes) -> float:
    """Fraction of an all_reduce hidden under a matmul issued right after it."""
    x = torch.randn(sizes.overlap_elements, device=device)
    a = torch.randn(sizes.matmul_dim, sizes.matmul_dim, device=device)
    t_comm = timed_on_devices(dist, lambda: dist.all_reduce(x), sync, device, 3)
    t_mm = timed_on_devices(dist, lambda: a @ a, sync, device, 3)
    reps = int(_max_over_ranks(dist, float(max(1, round(t_comm / t_mm))), device))

    def both():
        work = dist.all_reduce(x, async_op=True)
        for _ in range(reps):
            a @ a
        work.wait()
    return _hidden(t_mm * reps, t_comm, timed_on_devices(dist, both, sync, device, 2))


def _ring_overlap(dist, rank: int, world: int, device: torch.device, sync,
                  sizes: LinkSizes) -> float:
    """Fraction of a ring step (send to the next rank, receive from the previous, posted
    asynchronously) hidden under a matmul."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = torch.randn(sizes.ring_elements, device=device)
    inbox = torch.empty_like(out)
    a = torch.randn(sizes.matmul_dim, sizes.matmul_dim, device=device)

    def step(compute: bool, send: bool):
        def run():
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt),
                                           dist.P2POp(dist.irecv, inbox, prv)]) if send else []
            if compute:
                a @ a
            for req in reqs:
                req.wait()
        return run
    t_mm, t_comm, both = (timed_on_devices(dist, step(c, s), sync, device, 3)
                          for c, s in ((True, False), (False, True), (True, True)))
    return _hidden(t_mm, t_comm, both)


def _hidden(compute: float, comm: float, both: float) -> float:
    return max(0.0, min(1.0, (compute + comm - both) / max(min(compute, comm), 1e-12)))


def _bind(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def run_link_worker(rank: int, world: int, local_world: int, device_type: str, backend: str,
                    sizes: LinkSizes, init_method: str = "env://") -> dict | None:
    """One process's part of the measurement (every process of every node calls it); the
    raw figures on rank 0, None elsewhere."""
    import torch.distributed as dist

    if world % local_world:
        raise ValueError(f"{world} processes do not make whole nodes of {local_world}")
    device = _bind(device_type, rank % local_world)
    # device_id binds NCCL's communicator to this rank's GPU (barriers included)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            **bound)
    try:
        sync = device_sync(device)
        intra: dict[str, dict[int, list]] = {op: {} for op in COLLECTIVES}
        for g in node_group_sizes(local_world):
            group, members = _partition(dist, rank, [list(range(s, s + g))
                                                     for s in range(0, world, g)])
            for op, points in _time_ops(dist, COLLECTIVES, sizes.messages, rank, group,
                                        members, device, sync).items():
                intra[op][g] = points
        cross: dict[str, list] = {}
        if world > local_world:
            group, members = _partition(dist, rank, [list(range(i, world, local_world))
                                                     for i in range(local_world)])
            cross = _time_ops(dist, CROSS_NODE_OPS, sizes.messages, rank, group, members,
                              device, sync)
        overlap = _overlap(dist, device, sync, sizes)
        ring = _ring_overlap(dist, rank, world, device, sync, sizes)
    finally:
        dist.destroy_process_group()
    if rank:
        return None
    return {"intra": intra, "cross": cross, "nodes": world // local_world,
            "overlap": overlap, "ring_overlap": ring}


def _spawned(index: int, world: int, local_world: int, device_type: str, backend: str,
             sizes: LinkSizes, port: int, out_dir: str) -> None:
    data = run_link_worker(index, world, local_world, device_type, backend, sizes,
                           f"tcp://127.0.0.1:{port}")
    if data is not None:
        torch.save(data, os.path.join(out_dir, "links.pt"))


def measure_links(processes: int, device_type: str = "cuda", backend: str = "nccl",
                  sizes: LinkSizes = GPU_QUICK, per_node: int | None = None) -> LinkFigures:
    """Spawn ``processes`` processes on this machine, one per local device, and measure.

    ``per_node`` (default: all of them) cuts them into pretend nodes: the CPU tests use it
    to run the cross-node path on one machine; a real multi-node profile runs under
    torchrun instead (:func:`run_link_worker` in every process)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(processes, per_node or processes, device_type, backend, sizes,
                                 _free_port(), tmp), nprocs=processes, join=True)
        return figures_of(torch.load(os.path.join(tmp, "links.pt")))


def figures_of(data: dict) -> LinkFigures:
    """Fit the raw (bytes, seconds) points of :func:`run_link_worker`."""
    intra = {op: {g: fit_latency_bandwidth(points) for g, points in by_size.items()}
             for op, by_size in data["intra"].items() if by_size}
    cross = {op: fit_latency_bandwidth(points) for op, points in data["cross"].items()}
    return LinkFigures(intra=intra, cross=cross, nodes=data["nodes"],
                       overlap=data["overlap"], ring_overlap=data["ring_overlap"])
