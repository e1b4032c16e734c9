"""Local validation: time real tessera training steps and compare them with the simulator.

:func:`measure_strategies` runs the strategies in small batches (:data:`BATCH_SIZE`), each in
a fresh set of ``world`` gloo worker processes on this machine. In it, every strategy of the
batch gets a :class:`tessera.train.trainer.Trainer` for the reference transformer
(:data:`VALIDATION_MODEL`) on synthetic tokens and ``warmup`` untimed steps; then they are
timed round-robin, one step each per round, every other round in reverse order. Each timed
step starts at a barrier and lasts until the slowest rank has finished it (a MAX all-reduce
of the per-rank seconds); the figure is the median over the rounds. In each round a strategy
first takes SETTLE_STEPS untimed steps, so the timed one runs warm, as the steps of a
training run do.

The machine may be shared with other programs whose load changes within minutes, and what
CPU workers get from shared cores is the largest term of a small model's step. So the two
contention figures of ``tessera profile`` (the compute share of ``world`` concurrent workers,
the sync penalty of a blocking collective by group size, and the straggler fraction of
``world`` workers) are measured again inside each batch, once per round between the timed
steps, and returned with each strategy's times (medians; the straggler's mean over all its
tries): the prediction then describes the machine as that strategy's steps saw it. Nothing is
fitted to the measured steps. :func:`candidate_strategies` lists the strategies measured, keeping
only those that :meth:`Strategy.is_runnable` accepts when it is called, so the set grows as
runtimes land.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from typing import Any

import torch

from tessera.models.config import ModelConfig
from tessera.strategy import Strategy

# The reference transformer (GPT-2 style) at a size where one step takes ~0.1-0.5 s on a
# shared CPU core: 4 heads and 4 layers so that tp=4 (1d, and 2d as a 2 x 2 grid), ulysses
# sp=4 and pp=4 all divide it; seq 128 so that the zigzag ring of sp=4 has 16-token blocks.
VALIDATION_MODEL = dict(n_layers=4, d_model=128, n_heads=4, vocab_size=256, max_seq_len=128)

# Candidate strategies by worker count, before filtering with Strategy.is_runnable. Every
# one uses the global batch of its group, so the fastest of a group is a real choice.
_CANDIDATES = {
    4: [
        "dp=4,mbs=2,gbs=8",
        "dp=4,mbs=1,gbs=8",
        "dp=4,mbs=2,gbs=8,recompute=full",
        "dp=4,mbs=2,gbs=8,memory=chunk",
        "dp=4,mbs=1,gbs=8,memory=chunk",
        "dp=2,tp=2,mbs=4,gbs=8",
        "dp=1,tp=4,mbs=8,gbs=8",
        # Megatron sequence parallelism: on gloo its all-gathers and reduce-scatters cost more
        # than the all-reduces they replace (docs/tensor_parallel.md)
        "dp=2,tp=2,mbs=4,gbs=8,tp_seq=on",
        "dp=1,tp=4,mbs=8,gbs=8,tp_seq=on",
        "dp=1,tp=4,mbs=4,gbs=8,tp_mode=2d",
        "dp=2,pp=2,mbs=2,gbs=8,schedule=1f1b",
        "dp=2,pp=2,mbs=1,gbs=8,schedule=interleaved",
        "dp=1,pp=4,mbs=2,gbs=8,schedule=gpipe",
        "dp=1,pp=4,mbs=1,gbs=8,schedule=1f1b",
        "dp=2,pp=2,mbs=2,gbs=8,schedule=scp,recompute=full",
        "dp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk",
        "dp=1,sp=4,mbs=8,gbs=8,sp_mode=ring",
        "dp=1,sp=4,mbs=8,gbs=8,sp_mode=ulysses",
        "dp=2,sp=2,mbs=4,gbs=8,sp_mode=ring,recompute=full",
        "dp=2,sp=2,mbs=4,gbs=8,sp_mode=ulysses",
        # Compositions (each was filtered out until its refusal was lifted).
        "dp=1,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b",
        "dp=1,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,tp_seq=on",
        "dp=1,tp=2,sp=2,mbs=8,gbs=8,sp_mode=ulysses",
        "dp=1,sp=2,pp=2,mbs=4,gbs=8,schedule=1f1b",
        "dp=2,tp=2,mbs=4,gbs=8,memory=chunk",
        "dp=1,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk",
        "dp=1,sp=2,pp=2,mbs=4,gbs=8,schedule=1f1b,memory=chunk",
    ],
    8: [
        "dp=8,mbs=1,gbs=8",
        "dp=2,tp=4,mbs=4,gbs=8",
        "dp=4,pp=2,mbs=1,gbs=8,schedule=1f1b",
        "dp=2,sp=4,mbs=4,gbs=8,sp_mode=ulysses",
        "dp=8,mbs=1,gbs=8,memory=chunk",
        "dp=1,tp=4,pp=2,mbs=4,gbs=8,tp_mode=2d,schedule=1f1b",
    ],
}


# Untimed steps a strategy takes in each round before its timed one (see _measure_worker).
SETTLE_STEPS = 1

# Strategies measured in one set of workers. Every Trainer keeps its process groups, and gloo's
# loop threads take CPU time even while their groups are idle: with all 22 strategies' Trainers
# in each worker (251 threads) those threads took twice the CPU time during a dp=4 step, and the
# step ran 15-20% slower (84 vs 71 ms) than with its own Trainer alone, which is what a
# training job has; it slowed steadily as the others were built. A batch of 4 holds about a
# fifth of those threads.
BATCH_SIZE = 4


def validation_model() -> ModelConfig:
    """The model every local validation strategy trains."""
    return ModelConfig(**VALIDATION_MODEL)


def candidate_strategies(world: int) -> list[Strategy]:
    """The runnable validation strategies for ``world`` workers (none for other counts)."""
    model = validation_model()
    out = []
    for text in _CANDIDATES.get(world, []):
        strategy = Strategy.parse(text).validate_for(world_size=world, model=model)
        if strategy.is_runnable():
            out.append(strategy)
    return out


def measure_strategies(world: int, strategies: list[Strategy], steps: int = 5,
                       warmup: int = 2, timeout: float = 600.0,
                       model: dict[str, Any] | None = None, batch_size: int = BATCH_SIZE
                       ) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
    """Median measured step seconds (slowest rank) of each strategy on ``world`` workers.

    The strategies are measured in batches of at most ``batch_size`` (strategy i in batch
    ``i mod batches``, so each batch mixes families), each batch in a fresh set of workers.

    Returns one dict per strategy, in the order given: ``strategy`` (text), ``measured_s``
    (median), ``steps_s`` (every timed step) and ``contention``, what was probed between the
    rounds of its batch: ``{"concurrency": {world: share}, "sync_penalty": {g: seconds},
    "straggler": {world: fraction}}`` (medians over the rounds; the straggler's mean, as
    ``tessera profile`` takes it); and the same figures over every batch's rounds.
    ``model`` overrides :data:`VALIDATION_MODEL` (ModelConfig fields).
    """
    from tessera.testing import run_distributed

    if steps < 1 or warmup < 0 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1 and warmup >= 0, got {steps}, "
                         f"{batch_size} and {warmup}")
    texts = [s.to_text() for s in strategies]
    config = model or VALIDATION_MODEL
    n_batches = max(1, math.ceil(len(texts) / batch_size))
    rows: dict[int, dict[str, Any]] = {}
    all_probes = []
    for batch in range(n_batches):
        indices = list(range(batch, len(texts), n_batches))
        times, probes = run_distributed(
            _measure_worker, world, args=(config, [texts[i] for i in indices], steps, warmup),
            timeout=timeout)[0]
        all_probes += probes
        contention = _contention(world, probes)
        for i, t in zip(indices, times):
            rows[i] = {"strategy": texts[i], "measured_s": statistics.median(t), "steps_s": t,
                       "contention": contention}
    return [rows[i] for i in range(len(texts))], _contention(world, all_probes)


def _contention(world: int, probes: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    return {"concurrency": {world: statistics.median(p["share"] for p in probes)},
            "sync_penalty": {g: statistics.median(p["penalty"][g] for p in probes)
                             for g in probes[0]["penalty"]},
            "straggler": {world: statistics.fmean(p["straggler"] for p in probes)}}


def _synthetic_dataset(n: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=gen)
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]


def _measure_worker(rank: int, world: int, model: dict[str, Any], texts: list[str], steps: int,
                    warmup: int):
    """Build every strategy's Trainer, warm each up, then time them in round-robin rounds,
    so that load from other programs on a shared machine spreads over all strategies alike;
    probe the contention once per round."""
    import torch.distributed as dist

    from tessera.config import TrainingArguments
    from tessera.models import Transformer
    from tessera.planner.profile_comm import (concurrent_share, partition_group,
                                               straggler_of, sync_penalty_of)
    from tessera.train.trainer import Trainer

    config = ModelConfig(**model)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=1000, warmup_steps=0,
                                 progress="off", device="cpu", logging_steps=1000)
        trainers = []
        for text in texts:
            strategy = Strategy.parse(text)
            data = _synthetic_dataset(4 * strategy.global_batch_size, config.max_seq_len,
                                      config.vocab_size)
            torch.manual_seed(0)
            trainers.append(Trainer(Transformer(config), args, data, strategy=strategy))
            for _ in range(warmup):
                _timed_step(dist, trainers[-1])
        sizes = [g for g in (2, 4, 8) if g <= world]
        groups = {g: partition_group(dist, rank, world, g) for g in sizes}
        times: list[list[float]] = [[] for _ in texts]
        probes = []
        for round_ in range(steps):
            probes.append({"share": concurrent_share(dist, rank, world),
                           "penalty": {g: sync_penalty_of(dist, *groups[g], rounds=20,
                                                          repeats=1) for g in sizes},
                           # Equal tries per round: their mean over rounds is the mean of all.
                           "straggler": straggler_of(dist, rank, world, world, reps=8)})
            # Every other round in reverse, so no strategy always runs first after the
            # probes (or right after the same neighbour).
            order = list(enumerate(trainers))
            for index, trainer in order[::-1] if round_ % 2 else order:
                # Untimed steps first: a training run steps the same model again and again,
                # so its caches, allocator and autograd state are warm; right after another
                # strategy's step they are not (that cold step was ~20% slower).
                for _ in range(SETTLE_STEPS):
                    _timed_step(dist, trainer)
                times[index].append(_timed_step(dist, trainer))
    return times, probes


def _timed_step(dist, trainer) -> float:
    """Seconds of one training step on the slowest rank, started together at a barrier."""
    dist.barrier()
    start = time.perf_counter()
    trainer._train_step()
    trainer.step += 1
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)
