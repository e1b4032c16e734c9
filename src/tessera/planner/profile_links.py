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
from tessera.planner.profile_comm import (_free_port, agree_max, collective_fn,
                                          fit_latency_bandwidth, members_of, partition)

# Measured across nodes: the cross-node link is the one that reproduces this fit (the planner
# has one link per device between nodes, so other collectives would have nowhere to go).
CROSS_NODE_OPS = ("all_reduce",)


@dataclass(frozen=True)
class LinkSizes:
    """What the link measurement moves.

    Attributes:
        messages: bytes per device of each timed collective.
        overlap_elements: fp32 elements of the all_reduce timed against matmuls.
        matmul_dim: the square matmul repeated beside it, in the training dtype; as many
            as take about as long as the communication, so neither hides in the other's
            noise.
        ring_elements: fp32 elements of the ring step timed against such matmuls.
        host_bytes: bytes of the host <-> device copies (CUDA only).
    """

    messages: tuple[int, ...]
    overlap_elements: int
    matmul_dim: int
    ring_elements: int
    host_bytes: int = 1 << 28


# NCCL's latency regime starts below 64 KiB and its bandwidth regime above a few MiB; 1 GiB
# per device fits any GPU tessera plans for. A 4096^3 bf16 matmul is ~0.2 ms on an H100.
GPU_QUICK = LinkSizes(tuple(2**p for p in range(16, 29, 3)), 1 << 26, 4096, 1 << 22)
GPU_FULL = LinkSizes(tuple(2**p for p in range(12, 31, 2)), 1 << 26, 4096, 1 << 22)


@dataclass(frozen=True)
class LinkFigures:
    """What :func:`measure_links` found.

    Attributes:
        intra: fits inside a node, ``{op: {group size: fit}}``.
        cross: fits of a group with one device per node, ``{op: fit}``; empty for one node.
        nodes: nodes measured; ``cross`` fits are for a group of this size.
        overlap: fraction of an all_reduce hidden under concurrent matmuls.
        ring_overlap: the same for an asynchronous send/recv ring step inside a node.
        host_bandwidth: bytes/s of the slower direction of pinned host <-> device copies,
            every device of a node copying at once (they share PCIe switches and host
            memory), the slowest device's; None on CPU processes.
    """

    intra: Mapping[str, Mapping[int, CollectiveFit]]
    cross: Mapping[str, CollectiveFit]
    nodes: int
    overlap: float
    ring_overlap: float
    host_bandwidth: float | None = None


def node_group_sizes(local_world: int) -> list[int]:
    """Group sizes measured inside a node: the powers of two dividing it, and the node."""
    return sorted({g for g in (2, 4, 8, 16) if g < local_world and local_world % g == 0}
                  | ({local_world} if local_world > 1 else set()))


def device_sync(device: torch.device) -> Callable[[], None]:
    """A call that waits until ``device`` has finished its queued work (no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_on_device(fn: Callable[[], object], sync: Callable[[], None], min_time: float = 0.05,
                   repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds per call of ``fn``: calls are queued in doubling batches
    until a batch, ended by ``sync``, lasts ``min_time`` (a GPU call returns before its
    kernel has run, so only a synchronised batch measures the device)."""
    fn()
    sync()
    best, calls = float("inf"), 1
    for _ in range(repeat):
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
            calls *= 2
        best = min(best, elapsed / calls)
    return best


def host_link_rate(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bytes/s of the slower direction of a pinned host <-> device copy (the offload link)."""
    sync = device_sync(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up = time_on_device(lambda: on_device.copy_(host, non_blocking=True), sync)
    down = time_on_device(lambda: host.copy_(on_device, non_blocking=True), sync)
    return nbytes / max(up, down)


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
    return agree_max(dist, statistics.median(samples), device)


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


def _matmul(device: torch.device, dim: int) -> Callable[[], object]:
    """One ``dim``-square matmul in the training dtype (bf16 on a GPU, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(dim, dim, device=device, dtype=dtype)
    return lambda: a @ a


def _beside(dist, comm: Callable[[], object], start: Callable[[], list], device, sync,
            sizes: LinkSizes) -> float:
    """Fraction of ``comm`` (timed blocking) hidden when ``start`` posts it asynchronously
    (returning its works) before as many matmuls as take about as long."""
    matmul = _matmul(device, sizes.matmul_dim)
    t_comm = timed_on_devices(dist, comm, sync, device, 3)
    t_mm = timed_on_devices(dist, matmul, sync, device, 3)
    reps = int(agree_max(dist, float(max(1, round(t_comm / t_mm))), device))

    def both():
        works = start()
        for _ in range(reps):
            matmul()
        for work in works:
            work.wait()
    return _hidden(t_mm * reps, t_comm, timed_on_devices(dist, both, sync, device, 2))


def _overlap(dist, device: torch.device, sync, sizes: LinkSizes) -> float:
    """Fraction of an all_reduce hidden under matmuls issued right after it."""
    x = torch.randn(sizes.overlap_elements, device=device)
    return _beside(dist, lambda: dist.all_reduce(x),
                   lambda: [dist.all_reduce(x, async_op=True)], device, sync, sizes)


def _ring_overlap(dist, rank: int, members: list[int], device: torch.device, sync,
                  sizes: LinkSizes) -> float:
    """Fraction of a ring step inside the node (send to the next member, receive from the
    previous, posted asynchronously as ring attention does) hidden under matmuls."""
    index = members.index(rank)
    nxt, prv = members[(index + 1) % len(members)], members[(index - 1) % len(members)]
    out = torch.randn(sizes.ring_elements, device=device)
    inbox = torch.empty_like(out)

    def post():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt),
                                       dist.P2POp(dist.irecv, inbox, prv)])

    def blocking():
        for work in post():
            work.wait()
    return _beside(dist, blocking, post, device, sync, sizes)


def _hidden(compute: float, comm: float, both: float) -> float:
    return max(0.0, min(1.0, (compute + comm - both) / max(min(compute, comm), 1e-12)))


def _bind(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        # a launcher that shows each process only its own GPU leaves one visible device
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    torch.set_num_threads(1)
    return torch.device("cpu")


def run_link_worker(rank: int, world: int, local_world: int, device_type: str, backend: str,
                    sizes: LinkSizes, init_method: str = "env://") -> dict | None:
    """One process's part of the measurement (every process of every node calls it); the
    raw figures on rank 0, None elsewhere."""
    import torch.distributed as dist

    if world % local_world:
        raise ValueError(f"{world} processes do not make whole nodes of {local_world}")
    device = _bind(device_type, int(os.environ.get("LOCAL_RANK", rank % local_world)))
    # device_id binds NCCL's communicator to this rank's GPU (barriers included)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            **bound)
    try:
        sync = device_sync(device)
        intra: dict[str, dict[int, list]] = {op: {} for op in COLLECTIVES}
        for g in node_group_sizes(local_world):
            group, members = partition(dist, rank, [list(range(s, s + g))
                                                     for s in range(0, world, g)])
            for op, points in _time_ops(dist, COLLECTIVES, sizes.messages, rank, group,
                                        members, device, sync).items():
                intra[op][g] = points
        cross: dict[str, list] = {}
        if world > local_world:
            group, members = partition(dist, rank, [list(range(i, world, local_world))
                                                     for i in range(local_world)])
            cross = _time_ops(dist, CROSS_NODE_OPS, sizes.messages, rank, group, members,
                              device, sync)
        overlap = _overlap(dist, device, sync, sizes)
        node = members_of(world, local_world, rank)
        ring = _ring_overlap(dist, rank, node, device, sync, sizes) if local_world > 1 \
            else overlap
        host = None
        if device.type == "cuda":  # every device at once: the slowest one's rate
            dist.barrier()
            seconds = 1.0 / host_link_rate(device, sizes.host_bytes)
            host = 1.0 / agree_max(dist, seconds, device)
    finally:
        dist.destroy_process_group()
    if rank:
        return None
    return {"intra": intra, "cross": cross, "nodes": world // local_world,
            "overlap": overlap, "ring_overlap": ring, "host_bandwidth": host}


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
                       overlap=data["overlap"], ring_overlap=data["ring_overlap"],
                       host_bandwidth=data.get("host_bandwidth"))
