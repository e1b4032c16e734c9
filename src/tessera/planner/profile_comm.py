"""Measurements that need several gloo worker processes at once (``tessera profile``).

Collectives under load, the overlap of communication with compute, the compute share of g
workers sharing cores and their straggler fraction: each is measured with every worker busy,
as training sees it. :func:`measure_collectives` spawns the workers and returns the figures;
the local validation reuses :func:`concurrent_share`, :func:`partition_group` and
:func:`sync_penalty_of` to probe the same machine between its timed rounds.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from typing import Callable

import torch

from tessera.distributed import reduce_scatter_flat
from tessera.planner.cluster import COLLECTIVES, CollectiveFit


def time_call(fn: Callable[[], object], min_time: float = 0.05, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds per call, each run at least ``min_time`` long."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = min(best, elapsed / calls)
    return best


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sizes(quick: bool) -> list[int]:
    return [2**p for p in (range(12, 25, 3) if quick else range(10, 26, 2))]


def _group_sizes(world: int) -> list[int]:
    """Group sizes to measure: powers of two below ``world``, and ``world`` itself."""
    return sorted({g for g in (2, 4, 8, 16, 32) if g < world} | {world})


def _worker(rank: int, world: int, port: int, quick: bool, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results: dict[str, dict[int, list[tuple[int, float]]]] = {op: {} for op in COLLECTIVES}
    for g in _group_sizes(world):
        group, size = partition_group(dist, rank, world, g)
        members = members_of(world, g, rank)
        for nbytes in _sizes(quick):
            for op in COLLECTIVES:
                t = _loaded_collective(dist, op, nbytes // 4, rank, group, members)
                results[op].setdefault(g, []).append((nbytes, t))
    overlap = _overlap(dist, quick) if world >= 2 else 0.5
    ring_overlap = _ring_overlap(dist, rank, world) if world >= 2 else overlap
    concurrency = {g: _concurrent_rate(dist, rank, g) for g in range(1, world + 1)}
    straggler = {g: straggler_of(dist, rank, world, g) for g in _group_sizes(world)}
    if rank == 0:
        torch.save({"results": results, "overlap": overlap, "ring_overlap": ring_overlap,
                    "concurrency": concurrency, "straggler": straggler},
                   os.path.join(out_dir, "coll.pt"))
    dist.destroy_process_group()


def members_of(world: int, g: int, rank: int) -> list[int]:
    """The global ranks of this rank's group of ``g`` (consecutive ranks, as partition_group)."""
    start = rank - rank % g
    return list(range(start, min(start + g, world)))


def collective_fn(dist, op: str, n: int, rank: int, group, members: list[int],
                  device: torch.device | None = None):
    """One call of ``op`` on ``n`` fp32 elements in ``group``, on ``device`` (default the
    CPU; a CUDA device for NCCL); None for a group of one or a rank without a p2p peer."""
    g = len(members)
    if g < 2:
        return None
    x = torch.randn(max(g, n - n % g), device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":  # the gathered output is n elements, as comm.py counts it
        # in place: this member's part is its own slice of the output (NCCL's convention)
        chunk = x.numel() // g
        part = x.narrow(0, members.index(rank) * chunk, chunk)
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if op == "reduce_scatter":
        out = x.new_empty(x.numel() // g)  # the runtime's call (chunk ZeRO, Megatron-SP)
        return lambda: reduce_scatter_flat(out, x.view(g, -1), group)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if op == "broadcast":  # from the group's first member
        return lambda: dist.broadcast(x, src=members[0], group=group)
    index = members.index(rank)
    if op == "ring_step":  # every member sends to the next, receives from the previous
        nxt, prv = members[(index + 1) % g], members[(index - 1) % g]
        # As the ring attention runtime sends a step: K and V (half the bytes each) and the
        # small token metadata, three messages in one batch (each message costs its own
        # hand-off: three took ~40% longer than one on 4 workers sharing 2 cores).
        sent = [x[: x.numel() // 2], x[x.numel() // 2:],
                torch.zeros(64, dtype=torch.long, device=device)]
        inbox = [torch.empty_like(t) for t in sent]

        def ring_step():
            ops = [op for out, into in zip(sent, inbox)
                   for op in (dist.P2POp(dist.isend, out, nxt, group),
                              dist.P2POp(dist.irecv, into, prv, group))]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return ring_step
    # p2p: members in pairs (0, 1), (2, 3), ...; one message each way (halved by the caller)
    peer = members[index ^ 1] if (index ^ 1) < g else None
    if peer is None:
        return None
    first = index % 2 == 0

    def exchange():
        if first:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    return exchange


def _loaded_collective(dist, op: str, n: int, rank: int, group, members: list[int]) -> float:
    """Extra seconds per call of ``op`` on ``n`` fp32 elements, measured as training sees it:
    every worker (every group at once) computes about a millisecond between calls, and the
    loop with the calls is compared with the same loop without them. With more workers than
    cores a call also waits for members to be scheduled again, and a member's copy competes
    with the others' compute; a fit measured on otherwise idle workers sees neither (it was
    2-4x low for the 3 MB gradient all-reduce of 4 workers on 2 cores)."""
    fn = collective_fn(dist, op, n, rank, group, members)
    rounds = 20 if n * 4 <= 1 << 18 else 6
    extra = _mean_over_ranks(dist, _extra_per_call(dist, fn, rounds, repeats=5))
    return extra / 2 if op == "p2p" else extra


def _extra_per_call(dist, fn, rounds: int, repeats: int) -> float:
    """This rank's extra seconds per call of ``fn`` (None: no call) in a loop where every
    worker computes about a millisecond between calls, over the same loop without the
    calls (medians of ``repeats`` loops; every rank must call with the same counts)."""
    a = torch.randn(160, 160)

    def loop(sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            for _ in range(4):
                a @ a
            if sync and fn is not None:
                fn()
        return time.perf_counter() - start

    loop(True)
    free = statistics.median(loop(False) for _ in range(repeats))
    synced = statistics.median(loop(True) for _ in range(repeats))
    return max(0.0, (synced - free) / rounds)


def _mean_over_ranks(dist, value: float) -> float:
    """Every rank's value averaged (each rank's loop is one sample of the same quantity)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _ring_overlap(dist, rank: int, world: int, rounds: int = 10) -> float:
    """Fraction of a ring step's send/recv (256 KB to the next rank, from the previous, posted
    asynchronously as ring attention does) hidden under about a millisecond of compute,
    with every worker in the ring at once: (compute + comm - both) / min(compute, comm)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out, inp = torch.randn(1 << 16), torch.empty(1 << 16)
    a = torch.randn(160, 160)

    def loop(compute: bool, send: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt),
                                           dist.P2POp(dist.irecv, inp, prv)]) if send else []
            if compute:
                for _ in range(4):
                    a @ a
            for req in reqs:
                req.wait()
        return time.perf_counter() - start

    loop(True, True)
    times = {key: statistics.median(loop(*key) for _ in range(5))
             for key in ((True, False), (False, True), (True, True))}
    comp, comm, both = times[(True, False)], times[(False, True)], times[(True, True)]
    hidden = max(0.0, comp + comm - both) / max(min(comp, comm), 1e-9)
    return min(1.0, _mean_over_ranks(dist, hidden))


def _overlap(dist, quick: bool) -> float:
    """Fraction of an all_reduce hidden when a matmul runs at the same time."""
    x = torch.randn(1 << (20 if quick else 22))
    a = torch.randn(512, 512)

    def matmuls():
        for _ in range(8):
            a @ a

    def comm():
        dist.all_reduce(x)

    t_mm = time_call(matmuls, 0.02, 2)
    # Collectives must run the same number of times on every rank: fixed counts, no timing loop.
    comm()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        comm()
    t_ar = (time.perf_counter() - start) / 3
    t_ar = agree_max(dist, t_ar)
    reps = max(1, int(round(t_ar / t_mm)))
    reps = int(agree_max(dist, float(reps)))
    dist.barrier()
    start = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    for _ in range(reps):
        matmuls()
    work.wait()
    both = time.perf_counter() - start
    t_mm_total = reps * t_mm
    hidden = t_mm_total + t_ar - both
    return float(max(0.0, min(1.0, hidden / min(t_ar, t_mm_total))))


def _layer_step() -> Callable[[], object]:
    """Forward and backward of one small reference transformer block: the mix of matmuls,
    attention and element-wise kernels a training step runs (a matmul alone overstates what
    workers sharing cores get: it stays in cache, the element-wise kernels do not)."""
    from tessera.models.config import ModelConfig
    from tessera.models.transformer import Block

    torch.manual_seed(0)
    block = Block(ModelConfig(n_layers=1, d_model=96, n_heads=3, vocab_size=16, max_seq_len=128))
    x = torch.randn(2, 128, 96, requires_grad=True)
    grad = torch.randn(2, 128, 96)
    return lambda: block(x).backward(grad)


def _group_windows(dist, rank: int, world: int, g: int, steps: int, windows: int
                   ) -> list[list[float]]:
    """Seconds each of ranks 0..g-1 takes for ``steps`` reference block steps started
    together (the other ranks wait), for each of ``windows`` windows: ``[[t_0 .. t_g-1]]``."""
    step = _layer_step()
    step()
    out = []
    for _ in range(windows):
        dist.barrier()
        start = time.perf_counter()
        if rank < g:
            for _ in range(steps):
                step()
        elapsed = torch.tensor([time.perf_counter() - start if rank < g else 0.0],
                               dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, elapsed)
        out.append([float(t) for t in every[:g]])
    return out


def _concurrent_rate(dist, rank: int, g: int, windows: int = 7) -> float:
    """Rate (steps/s) of one reference block's forward + backward on each of ranks 0..g-1
    computing at the same time (the others wait), over the slowest of them: a synchronous
    step ends when its last worker does, and a scheduler that runs two of four workers
    first would otherwise look fair. The median of ``windows`` windows of 20 steps, so a
    burst of other load counts once."""
    steps = 20
    times = _group_windows(dist, rank, dist.get_world_size(), g, steps, windows)
    return statistics.median(steps / max(window) for window in times)


def straggler_of(dist, rank: int, world: int, g: int, steps: int = 12, reps: int = 30) -> float:
    """How far the slowest of ranks 0..g-1 trails their median when each runs the same
    ``steps`` reference block steps from a common start (the others wait), as a fraction of
    the median; the mean of ``reps`` tries (a step waits for the expected slowest worker,
    and single tries scatter widely: with 15 tries three profiles gave 0.05, 0.10 and 0.15
    for 4 workers on 2 cores). With more workers than cores the scheduler hands out the
    cores unevenly, and a synchronous training step waits for the last. Every rank calls."""
    times = _group_windows(dist, rank, world, g, steps, reps)
    return statistics.fmean((max(w) - statistics.median(w)) / statistics.median(w)
                            for w in times)


def partition_group(dist, rank: int, world: int, g: int):
    """This rank's group when ranks are cut into consecutive groups of ``g``; returns
    (group, its size)."""
    group, members = partition(dist, rank, [list(range(s, min(s + g, world)))
                                            for s in range(0, world, g)])
    return group, len(members)


def partition(dist, rank: int, groups: list[list[int]]):
    """Create every group of ``groups`` (every rank must, as torch.distributed requires) and
    return this rank's (group, members)."""
    handles = [dist.new_group(members) for members in groups]
    index = next(i for i, members in enumerate(groups) if rank in members)
    return handles[index], groups[index]


def sync_penalty_of(dist, group, size: int, rounds: int = 40, repeats: int = 3) -> float:
    """Extra seconds per tiny all_reduce in ``group`` while every worker computes about a
    millisecond between collectives, over the same loop without them: the wait for members
    that share a busy core (every rank calls). ``tessera profile`` folds this into its loaded
    collective fits; the local validation probes it between rounds to see load drift."""
    flag = torch.zeros(1)
    fn = (lambda: dist.all_reduce(flag, group=group)) if size > 1 else None
    return agree_max(dist, _extra_per_call(dist, fn, rounds, repeats))


def concurrent_share(dist, rank: int, world: int, windows: int = 3) -> float:
    """Training-step rate (a reference block's forward + backward) of each of ``world``
    workers computing at once, over one alone."""
    return min(1.0, _concurrent_rate(dist, rank, world, windows)
               / _concurrent_rate(dist, rank, 1, windows))


def agree_max(dist, value: float, device: torch.device | None = None) -> float:
    """The largest of every rank's value (so all ranks take the same decisions); ``device``
    is where the backend reduces (a CUDA device for NCCL)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def fit_latency_bandwidth(points: list[tuple[int, float]]) -> CollectiveFit:
    """Least-squares latency + bytes / bandwidth, with both kept positive."""
    n = len(points)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 1e-15)
    latency = max(my - slope * mx, min(ys) * 0.5, 1e-7)
    return CollectiveFit(latency=latency, bandwidth=1.0 / slope)


def measure_collectives(workers: int, quick: bool
                        ) -> tuple[dict, tuple[float, float], dict, dict]:
    """Spawn ``workers`` gloo processes; return fits by op and group size (measured under
    load, :func:`_loaded_collective`), the overlap of an all-reduce and of a send/recv ring
    with compute, the compute share each of g concurrent workers gets (relative to one
    alone), and the straggler fraction of g workers (:func:`straggler_of`)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(workers, _free_port(), quick, tmp), nprocs=workers, join=True)
        data = torch.load(os.path.join(tmp, "coll.pt"))
    fits = {op: {g: fit_latency_bandwidth(points) for g, points in by_size.items()}
            for op, by_size in data["results"].items()}
    solo = data["concurrency"][1]
    shares = {g: min(1.0, rate / solo) for g, rate in data["concurrency"].items()}
    return fits, (data["overlap"], data["ring_overlap"]), shares, data["straggler"]
