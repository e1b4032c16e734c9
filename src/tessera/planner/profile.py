"""``tessera profile``: measure this machine and describe it as a cluster the planner reads.

What is measured, each with one thread per worker (as training workers run, OMP_NUM_THREADS=1):

- matmul throughput by shape (the table compute.py interpolates in);
- fused causal attention (scaled_dot_product_attention) forward + backward, as a fraction of
  the best matmul rate;
- element-wise memory bandwidth (an out-of-place add), one AdamW update's traffic per parameter,
  and the fixed cost of one small autograd kernel;
- collectives (all_reduce, all_gather, reduce_scatter, all_to_all, p2p, broadcast, and a ring
  step in which every member sends to the next and receives from the previous) over gloo for group
  sizes 2, 4, 8, ... and ``workers``, every group at once, each call following about a
  millisecond of compute on every worker (as in training: a member that shares a core with
  busy workers answers late), fitted as latency + bytes / bandwidth by least squares;
- how much of an all_reduce hides under a concurrent matmul (the overlap efficiency), and how
  much of an asynchronous send/recv ring step hides under compute (ring attention's overlap);
- the rate of a reference transformer block's forward + backward that each of g workers gets
  when g run at once (more workers than cores, or other load on a shared machine, show up
  here), and how far the slowest of g such workers trails their median (the straggler);
- the fixed Python and kernel-launch seconds of a training step of a tiny reference
  transformer (per layer, per model, per optimizer step), where FLOPs are negligible, and
  what the memory=chunk runtime adds per layer (a one-worker Trainer, chunk against ddp);
- the element-wise seconds per element of real reference transformer layers, and the seconds
  per score element of the sequence-parallel runtime's explicit block attention
  (calibrate.py).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.planner.calibrate import calibrate_block_attention, calibrate_elementwise
from tessera.planner.cluster import COLLECTIVES, Cluster, CollectiveFit
from tessera.planner.hardware import local_cpu

QUICK_SHAPES = [(64, 64, 64), (256, 256, 256), (512, 512, 256), (1024, 512, 512),
                (512, 1536, 512), (2048, 1024, 1024)]
FULL_SHAPES = QUICK_SHAPES + [(128, 128, 128), (128, 512, 128), (256, 1024, 256),
                              (512, 2048, 512), (1024, 1024, 1024), (4096, 1024, 1024),
                              (2048, 4096, 1024)]


def _timeit(fn: Callable[[], object], min_time: float = 0.05, repeat: int = 3) -> float:
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


def measure_matmul(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], float]]:
    """FLOP/s of ``(m, k) x (k, n)`` for each ``(m, n, k)``."""
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = _timeit(lambda: a @ b)
        out.append(((m, n, k), 2.0 * m * n * k / t))
    return out


def measure_attention(peak: float, seq: int = 256, heads: int = 4, head_dim: int = 64) -> float:
    """Fraction of ``peak`` that causal SDPA forward + backward reaches (causal FLOPs)."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.sum().backward()

    t = _timeit(step)
    flops = 4.0 * seq * seq * heads * head_dim * 0.5 * (1 + 2.5)
    return min(1.0, flops / t / peak)


def measure_memory(n: int = 1 << 22) -> tuple[float, float, float]:
    """(element-wise bytes/s, AdamW bytes per parameter, seconds per small autograd kernel)."""
    x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)
    bandwidth = 3 * 4 * n / _timeit(lambda: torch.add(x, y, out=z))
    params = [torch.nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    adam_bytes = _timeit(opt.step) * bandwidth / n
    w = torch.randn(8, 8, requires_grad=True)
    inp = torch.randn(2, 8)

    def tiny():
        h = F.gelu(F.linear(inp, w))
        (h + inp).sum().backward()

    # about 4 kernels forward and 8 backward
    overhead = _timeit(tiny) / 12
    return bandwidth, adam_bytes, overhead


def measure_overheads(rounds: int = 7) -> dict[str, float]:
    """Fixed seconds of a training step of the reference transformer at a size where the
    arithmetic is negligible (d_model 8, 4 tokens): the same modules, autograd graph, loss,
    clipping and AdamW as a real step, so what remains is per-op Python and launch cost.
    One and five layers separate the per-layer part from the rest; the two are timed in
    alternation and the fastest of ``rounds`` kept, so a burst of other load hits neither."""
    deep = 5  # five layers against one: the per-layer part is a difference of 4 layers
    steps = {depth: _tiny_step(depth) for depth in (1, deep)}
    best = {depth: [float("inf")] * 3 for depth in steps}
    for _ in range(rounds):
        for depth, parts in steps.items():
            times = [_timeit(fn, 0.02, 1) for fn in parts]
            best[depth] = [min(a, b) for a, b in zip(best[depth], times)]
    (f1, fb1, o1), (f5, fb5, o5) = best[1], best[deep]
    b1, b5 = max(0.0, fb1 - f1), max(0.0, fb5 - f5)
    layer = {"layer_fwd": max(0.0, f5 - f1) / (deep - 1),
             "layer_bwd": max(0.0, b5 - b1) / (deep - 1),
             "optim_layer": max(0.0, o5 - o1) / (deep - 1)}
    return {**layer, "model_fwd": max(0.0, f1 - layer["layer_fwd"]),
            "model_bwd": max(0.0, b1 - layer["layer_bwd"]),
            "optim_fixed": max(0.0, o1 - layer["optim_layer"])}


def _tiny_step(n_layers: int) -> tuple[Callable[[], object], ...]:
    """(forward + loss, forward + loss + backward, clip + AdamW + zero_grad) of a tiny
    reference transformer of ``n_layers`` layers."""
    from tessera.models import Transformer
    from tessera.models.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=n_layers, d_model=8, n_heads=2, vocab_size=16,
                                    max_seq_len=4))
    ids = torch.randint(0, 16, (1, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward():
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1))

    def forward_backward():
        forward().backward()

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    forward_backward()
    return forward, forward_backward, optimizer


def measure_chunk_overhead(n_layers: int = 4) -> float:
    """Seconds per layer and micro-batch that the ``memory=chunk`` runtime (its hooks, chunk
    copies and placement) adds over ``memory=ddp``: one worker training a tiny reference
    transformer with each, through the tessera Trainer."""
    from tessera.planner.validation import measure_strategies
    from tessera.strategy import Strategy

    model = dict(n_layers=n_layers, d_model=8, n_heads=2, vocab_size=16, max_seq_len=4)
    runs = [Strategy.parse(f"dp=1,mbs=1,gbs=1,memory={mem}") for mem in ("ddp", "chunk")]
    rows, _ = measure_strategies(1, runs, steps=7, warmup=2, model=model)
    return max(0.0, rows[1]["measured_s"] - rows[0]["measured_s"]) / n_layers


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
        members = _members(world, g, rank)
        for nbytes in _sizes(quick):
            for op in COLLECTIVES:
                t = _loaded_collective(dist, op, nbytes // 4, rank, group, members)
                results[op].setdefault(g, []).append((nbytes, t))
    overlap = _overlap(dist, quick) if world >= 2 else 0.5
    ring_overlap = _ring_overlap(dist, rank, world) if world >= 2 else overlap
    concurrency = {g: _concurrent_rate(dist, rank, g) for g in range(1, world + 1)}
    straggler = {g: _straggler(dist, rank, world, g) for g in _group_sizes(world)}
    if rank == 0:
        torch.save({"results": results, "overlap": overlap, "ring_overlap": ring_overlap,
                    "concurrency": concurrency, "straggler": straggler},
                   os.path.join(out_dir, "coll.pt"))
    dist.destroy_process_group()


def _members(world: int, g: int, rank: int) -> list[int]:
    """The global ranks of this rank's group of ``g`` (consecutive ranks, as partition_group)."""
    start = rank - rank % g
    return list(range(start, min(start + g, world)))


def _collective_fn(dist, op: str, n: int, rank: int, group, members: list[int]):
    """One call of ``op`` on ``n`` fp32 elements in ``group``; None for a group of one."""
    g = len(members)
    if g < 2:
        return None
    x = torch.randn(max(g, n - n % g))
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":  # the gathered output is n elements, as comm.py counts it
        part = x[: x.numel() // g]
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // g)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if op == "broadcast":  # from the group's first member
        return lambda: dist.broadcast(x, src=members[0], group=group)
    index = members.index(rank)
    if op == "ring_step":  # every member sends to the next, receives from the previous
        nxt, prv = members[(index + 1) % g], members[(index - 1) % g]
        inbox = torch.empty_like(x)

        def ring_step():
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group),
                                               dist.P2POp(dist.irecv, inbox, prv, group)]):
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
    fn = _collective_fn(dist, op, n, rank, group, members)
    a = torch.randn(160, 160)
    rounds = 20 if n * 4 <= 1 << 18 else 6

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
    free = statistics.median(loop(False) for _ in range(5))
    synced = statistics.median(loop(True) for _ in range(5))
    extra = _mean_over_ranks(dist, max(0.0, (synced - free) / rounds))
    return extra / 2 if op == "p2p" else extra


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

    t_mm = _timeit(matmuls, 0.02, 2)
    # Collectives must run the same number of times on every rank: fixed counts, no timing loop.
    comm()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        comm()
    t_ar = (time.perf_counter() - start) / 3
    t_ar = _agree(dist, t_ar)
    reps = max(1, int(round(t_ar / t_mm)))
    reps = int(_agree(dist, float(reps)))
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


def _concurrent_rate(dist, rank: int, g: int, windows: int = 7) -> float:
    """Rate (steps/s) of one reference block's forward + backward on each of ranks 0..g-1
    computing at the same time (the others wait), over the slowest of them: a synchronous
    step ends when its last worker does, and a scheduler that runs two of four workers
    first would otherwise look fair. The median of ``windows`` windows of 20 steps, so a
    burst of other load counts once."""
    step = _layer_step()
    calls = 20
    step()
    rates = []
    for _ in range(windows):
        dist.barrier()
        start = time.perf_counter()
        if rank < g:
            for _ in range(calls):
                step()
        elapsed = torch.tensor([time.perf_counter() - start if rank < g else 0.0],
                               dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        rates.append(calls / float(elapsed.item()))
    return statistics.median(rates)


def _straggler(dist, rank: int, world: int, g: int, steps: int = 12, reps: int = 7) -> float:
    """How far the slowest of ranks 0..g-1 trails their median when each runs the same
    ``steps`` reference block steps from a common start (the others wait), as a fraction of
    the median; the median of ``reps`` tries. With more workers than cores the scheduler
    hands out the cores unevenly, and a synchronous training step waits for the last."""
    step = _layer_step()
    step()
    fractions = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank < g:
            for _ in range(steps):
                step()
        elapsed = torch.tensor([time.perf_counter() - start if rank < g else 0.0])
        every = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(every, elapsed)
        times = sorted(float(t) for t in every[:g])
        middle = statistics.median(times)
        fractions.append((times[-1] - middle) / middle)
    return statistics.median(fractions)


def partition_group(dist, rank: int, world: int, g: int):
    """This rank's group when ranks are cut into consecutive groups of ``g`` (every rank
    creates every group, as torch.distributed requires); returns (group, its size)."""
    members = [list(range(s, min(s + g, world))) for s in range(0, world, g)]
    groups = [dist.new_group(m) for m in members]
    index = next(i for i, m in enumerate(members) if rank in m)
    return groups[index], len(members[index])


def sync_penalty_of(dist, group, size: int, rounds: int = 40, repeats: int = 3) -> float:
    """Extra seconds per tiny all_reduce in ``group`` while every worker computes about a
    millisecond between collectives, over the same loop without them: the wait for members
    that share a busy core (every rank calls). ``tessera profile`` folds this into its loaded
    collective fits; the local validation probes it between rounds to see load drift."""
    a, flag = torch.randn(160, 160), torch.zeros(1)

    def loop(sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            for _ in range(4):
                a @ a
            if sync and size > 1:
                dist.all_reduce(flag, group=group)
        return time.perf_counter() - start

    loop(True)
    free = statistics.median(loop(False) for _ in range(repeats))
    synced = statistics.median(loop(True) for _ in range(repeats))
    return _agree(dist, max(0.0, (synced - free) / rounds))


def concurrent_share(dist, rank: int, world: int, windows: int = 3) -> float:
    """Training-step rate (a reference block's forward + backward) of each of ``world``
    workers computing at once, over one alone."""
    return min(1.0, _concurrent_rate(dist, rank, world, windows)
               / _concurrent_rate(dist, rank, 1, windows))


def _agree(dist, value: float) -> float:
    """The largest of every rank's value (so all ranks take the same decisions)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _fit(points: list[tuple[int, float]]) -> CollectiveFit:
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
    alone), and the straggler fraction of g workers (:func:`_straggler`)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(workers, _free_port(), quick, tmp), nprocs=workers, join=True)
        data = torch.load(os.path.join(tmp, "coll.pt"))
    fits = {op: {g: _fit(points) for g, points in by_size.items()}
            for op, by_size in data["results"].items()}
    solo = data["concurrency"][1]
    shares = {g: min(1.0, rate / solo) for g, rate in data["concurrency"].items()}
    return fits, (data["overlap"], data["ring_overlap"]), shares, data["straggler"]


def profile_cluster(workers: int | None = None, quick: bool = False,
                    log: Callable[[str], None] = lambda msg: None) -> Cluster:
    """Measure this machine and return a one-node CPU cluster of ``workers`` workers.

    Args:
        workers: worker processes (default: CPU count, at least 2).
        quick: fewer shapes and message sizes.
        log: receives one line per measurement stage.
    """
    workers = workers or max(2, os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log("matmul throughput by shape ...")
        table = measure_matmul(QUICK_SHAPES if quick else FULL_SHAPES)
        peak = max(rate for _, rate in table)
        log("attention, memory bandwidth, optimizer, kernel overhead ...")
        attention = measure_attention(peak)
        bandwidth, adam_bytes, overhead = measure_memory()
        log("fixed per-layer and per-step overheads of a tiny reference transformer ...")
        overheads = measure_overheads()
    finally:
        torch.set_num_threads(threads)
    log(f"collectives over gloo with {workers} workers ...")
    fits, (overlap, ring_overlap), shares, straggler = measure_collectives(workers, quick)
    log("memory=chunk runtime overhead (one worker, tiny reference transformer) ...")
    overheads["chunk_layer"] = measure_chunk_overhead()
    base = local_cpu(workers)
    device = dataclasses.replace(
        base, peak_flops={"fp32": peak, "bf16": peak}, memory_bandwidth=bandwidth,
        attention_efficiency=attention, kernel_overhead=overhead,
        optimizer_bytes_per_param=adam_bytes, overlap_efficiency=overlap,
        p2p_overlap_efficiency=ring_overlap,
        memory_bytes=_memory_per_worker(workers), overheads=overheads)
    cluster = Cluster(device=device, devices_per_node=workers, nodes=1,
                      name=f"local-cpu:{workers}x1", matmul_table=tuple(table), collectives=fits,
                      compute_slots=os.cpu_count() or 1, concurrency=shares,
                      straggler=straggler)
    log("element-wise cost of reference layers and of block attention (one worker) ...")
    torch.set_num_threads(1)
    try:
        elementwise = {**calibrate_elementwise(cluster), **calibrate_block_attention()}
    finally:
        torch.set_num_threads(threads)
    device = dataclasses.replace(device, overheads={**overheads, **elementwise})
    return dataclasses.replace(cluster, device=device)


def _memory_per_worker(workers: int) -> float:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return total / workers
