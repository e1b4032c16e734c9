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
- what a 1D tensor-parallel layer adds per micro-batch and its clipping and AdamW per step
  (two workers, tp=2 with no-op collectives, against the unwrapped model), and a 2D layer
  likewise (four workers on a 2 x 2 grid, timed in turn; profile_tp.py);
- the element-wise seconds per element of real reference transformer layers, and the seconds
  per score element of the sequence-parallel runtime's block attention
  (calibrate.py).

The measurements that need several workers at once live in ``profile_comm.py``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.planner.calibrate import calibrate_block_attention, calibrate_elementwise
from tessera.planner.profile_tp import measure_tp_overheads
from tessera.planner.cluster import Cluster
from tessera.planner.hardware import local_cpu
from tessera.planner.profile_comm import time_call, measure_collectives

QUICK_SHAPES = [(64, 64, 64), (256, 256, 256), (512, 512, 256), (1024, 512, 512),
                (512, 1536, 512), (2048, 1024, 1024)]
FULL_SHAPES = QUICK_SHAPES + [(128, 128, 128), (128, 512, 128), (256, 1024, 256),
                              (512, 2048, 512), (1024, 1024, 1024), (4096, 1024, 1024),
                              (2048, 4096, 1024)]


def measure_matmul(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], float]]:
    """FLOP/s of ``(m, k) x (k, n)`` for each ``(m, n, k)``."""
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = time_call(lambda: a @ b)
        out.append(((m, n, k), 2.0 * m * n * k / t))
    return out


def measure_attention(peak: float, seq: int = 256, heads: int = 4, head_dim: int = 64,
                      dropout_p: float = 0.0) -> float:
    """Fraction of ``peak`` that causal SDPA forward + backward reaches (causal FLOPs), with
    attention dropout ``dropout_p`` (on CPU SDPA then takes its math path)."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        y.sum().backward()

    t = time_call(step)
    flops = 4.0 * seq * seq * heads * head_dim * 0.5 * (1 + 2.5)
    return min(1.0, flops / t / peak)


def measure_memory(n: int = 1 << 22) -> tuple[float, float, float]:
    """(element-wise bytes/s, AdamW bytes per parameter, seconds per small autograd kernel)."""
    x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)
    bandwidth = 3 * 4 * n / time_call(lambda: torch.add(x, y, out=z))
    params = [torch.nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    adam_bytes = time_call(opt.step) * bandwidth / n
    w = torch.randn(8, 8, requires_grad=True)
    inp = torch.randn(2, 8)

    def tiny():
        h = F.gelu(F.linear(inp, w))
        (h + inp).sum().backward()

    # about 4 kernels forward and 8 backward
    overhead = time_call(tiny) / 12
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
            times = [time_call(fn, 0.02, 1) for fn in parts]
            best[depth] = [min(a, b) for a, b in zip(best[depth], times)]
    (f1, fb1, o1), (f5, fb5, o5) = best[1], best[deep]
    b1, b5 = max(0.0, fb1 - f1), max(0.0, fb5 - f5)
    layer = {"layer_fwd": max(0.0, f5 - f1) / (deep - 1),
             "layer_bwd": max(0.0, b5 - b1) / (deep - 1),
             "optim_layer": max(0.0, o5 - o1) / (deep - 1)}
    return {**layer, "model_fwd": max(0.0, f1 - layer["layer_fwd"]),
            "model_bwd": max(0.0, b1 - layer["layer_bwd"]),
            "optim_fixed": max(0.0, o1 - layer["optim_layer"])}


def measure_overheads_fresh() -> dict[str, float]:
    """:func:`measure_overheads` in a fresh worker process, as the Trainer runs that
    :func:`measure_runtime_overheads` subtracts it from are measured: a long-lived caller
    (a test session, a notebook) runs the same bare loop up to half again slower (measured
    1.4x with 3 million small objects alive), which would hide the Trainer's own cost."""
    from tessera.testing import run_distributed

    return run_distributed(_overheads_worker, 1, timeout=600)[0]


def _overheads_worker(rank: int, world_size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    return measure_overheads()


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


def measure_runtime_overheads(plain_step: dict[str, float], n_layers: int = 4
                              ) -> dict[str, float]:
    """Seconds that tessera's runtimes add over a plain step, from one worker training a tiny
    reference transformer (arithmetic negligible) through the tessera Trainer, at one and at
    two micro-batches per step. ``plain_step`` is :func:`measure_overheads`' result: the same
    model's forward, backward, clipping and AdamW in a bare loop.

    - ``trainer_step`` per step and ``trainer_micro_batch`` per micro-batch: the Trainer
      itself (collating the batch, the engine's loss bookkeeping, clipping through the
      parallel plan, the learning-rate schedule) beyond the bare loop;
    - ``chunk_layer`` per micro-batch and ``chunk_step_layer`` per step: the ``memory=chunk``
      runtime's hooks, chunk copies and placement (each micro-batch), and its gradient
      reduction, clipping and chunked AdamW (once per step);
    - ``recompute_layer`` per micro-batch: what full recomputation costs beyond running the
      layer's forward again (``layer_fwd``, priced already): the checkpoint's saved-tensor
      hooks, RNG state and bookkeeping."""
    from tessera.planner.validation import measure_strategies
    from tessera.strategy import Strategy

    model = dict(n_layers=n_layers, d_model=8, n_heads=2, vocab_size=16, max_seq_len=4)
    runs = [Strategy.parse(f"dp=1,mbs=1,gbs={gbs},{extra}") for gbs, extra in
            ((1, "memory=ddp"), (1, "memory=chunk"), (1, "recompute=full"),
             (2, "memory=ddp"), (2, "memory=chunk"))]
    # One set of workers for all five: the figures are differences between these runs.
    rows, _ = measure_strategies(1, runs, steps=7, warmup=2, model=model, batch_size=len(runs))
    plain, chunk, recompute, plain2, chunk2 = (row["measured_s"] for row in rows)
    per_micro_batch = max(0.0, (chunk2 - plain2) - (chunk - plain))
    bare_micro_batch = (plain_step["model_fwd"] + plain_step["model_bwd"]
                        + n_layers * (plain_step["layer_fwd"] + plain_step["layer_bwd"]))
    bare_optimizer = plain_step["optim_fixed"] + n_layers * plain_step["optim_layer"]
    trainer_micro_batch = plain2 - plain  # one more micro-batch through the Trainer
    return {"trainer_micro_batch": max(0.0, trainer_micro_batch - bare_micro_batch),
            "trainer_step": max(0.0, plain - trainer_micro_batch - bare_optimizer),
            "chunk_layer": per_micro_batch / n_layers,
            "chunk_step_layer": max(0.0, chunk - plain - per_micro_batch) / n_layers,
            "recompute_layer": max(0.0, (recompute - plain) / n_layers
                                   - plain_step["layer_fwd"])}


def gpu_not_measured_note() -> str | None:
    """What to tell a user profiling CPU workers on a machine with CUDA devices (None
    without any)."""
    if not torch.cuda.is_available():
        return None
    return (f"note: this machine has {torch.cuda.device_count()} CUDA device(s); this profile "
            "measures CPU workers over gloo, not them: profile the GPUs with "
            "`tessera profile --device cuda`")


def profile_cluster(workers: int | None = None, quick: bool = False,
                    log: Callable[[str], None] = lambda msg: None) -> Cluster:
    """Measure this machine's CPU and return a one-node CPU cluster of ``workers`` workers
    (GPUs are profiled by ``profile_gpu.py``).

    Args:
        workers: worker processes (default: CPU count, at least 2).
        quick: fewer shapes and message sizes.
        log: receives one line per measurement stage.
    """
    workers = workers or max(2, os.cpu_count() or 1)
    note = gpu_not_measured_note()
    if note:  # say so: the file describes the CPU, not the GPUs
        log(note)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log("matmul throughput by shape ...")
        table = measure_matmul(QUICK_SHAPES if quick else FULL_SHAPES)
        peak = max(rate for _, rate in table)
        log("attention, memory bandwidth, optimizer, kernel overhead ...")
        attention = measure_attention(peak)
        attention_dropping = measure_attention(peak, dropout_p=0.1)
        bandwidth, adam_bytes, overhead = measure_memory()
        log("fixed per-layer and per-step overheads of a tiny reference transformer ...")
        overheads = measure_overheads_fresh()
    finally:
        torch.set_num_threads(threads)
    log(f"collectives over gloo with {workers} workers ...")
    fits, (overlap, ring_overlap), shares, straggler = measure_collectives(workers, quick)
    log("Trainer, memory=chunk and recomputation overheads (one worker, tiny reference "
        "transformer) ...")
    overheads.update(measure_runtime_overheads(overheads))
    # A 2D layer needs tp=4: only a cluster of 4 or more workers can plan one.
    layouts = ("tp", "tp2d") if workers >= 4 else ("tp",)
    log("tensor-parallel layer overheads (1D on two workers"
        + (", 2D on four" if "tp2d" in layouts else "") + "; tiny reference transformer) ...")
    overheads.update(measure_tp_overheads(layouts=layouts))
    base = local_cpu(workers)
    device = dataclasses.replace(
        # 16-bit at the measured fp32 rate: not measured (see local_cpu)
        base, peak_flops={"fp32": peak, "bf16": peak, "fp16": peak},
        memory_bandwidth=bandwidth,
        attention_efficiency=attention, attention_dropout_efficiency=attention_dropping,
        kernel_overhead=overhead,
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
        elementwise = {**calibrate_elementwise(cluster), **calibrate_block_attention(),
                       **calibrate_block_attention(dropout=True)}
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
