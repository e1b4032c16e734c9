"""What a 1D tensor-parallel layer costs beyond a plain one, for ``tessera profile``.

Two workers train a tiny reference transformer (arithmetic negligible) at tp=2 with the
tensor-parallel collectives made no-ops (the numbers are wrong; the Python, the autograd
functions and DTensor's dispatch are not), and the same model as plain dp=2 with DDP's
all-reduce made a no-op too, each at 1 and at 5 layers. The per-layer differences give the tp
layer's own overhead per micro-batch (the Engine's forward and backward) and per step (the
plan's gradient clipping and AdamW over DTensor parameters). The collectives themselves are
priced from the measured fits, as for every other layout.

A 2D (SUMMA) layer is measured the same way on four workers (a 2 x 2 grid, tp=4 with
tp_mode=2d): with its collectives no-ops no rank waits for another, so each rank's forward
and backward are timed in turn while the others sleep in a barrier, at a lone worker's rate
like the two-worker figures, and the plain layer of the dp=2 run is subtracted.
"""

from __future__ import annotations

import tempfile
import time

DEPTHS = (1, 5)  # five layers against one: the per-layer part is a difference of 4 layers


def measure_tp_overheads(rounds: int = 12) -> dict[str, float]:
    """``tp_layer`` (seconds per 1D tp layer and micro-batch beyond a plain layer's forward
    and backward), ``tp_optim_layer`` (per layer and step: clipping and AdamW over its
    DTensor shards beyond the plain layer's) and ``tp2d_layer`` (per 2D layer and
    micro-batch, like ``tp_layer``), at a lone worker's rate: two workers, each on its own
    core where the machine has two; the 2D ranks timed one at a time."""
    from tessera.testing import run_distributed

    best = run_distributed(_worker, world_size=2, args=(rounds,), timeout=600)[0]
    # The 2D grid's ranks do slightly different work; the step waits for the slowest.
    for rank_best in run_distributed(_worker_2d, world_size=4, args=(rounds,), timeout=600):
        for key, seconds in rank_best.items():
            best[key] = max(best.get(key, 0.0), seconds)
    layers = DEPTHS[1] - DEPTHS[0]

    def extra(kind: str, part: str) -> float:  # over dp, per layer
        return max(0.0, sum(sign * (best[(k, DEPTHS[1], part)] - best[(k, DEPTHS[0], part)])
                            for k, sign in ((kind, 1), ("dp", -1))) / layers)

    return {"tp_layer": extra("tp", "passes"), "tp_optim_layer": extra("tp", "tail"),
            "tp2d_layer": extra("tp2d", "passes")}


def _worker(rank: int, world: int, rounds: int) -> dict:
    """Fastest of ``rounds`` for each (kind, depth, part): the Engine's forward and backward
    of one micro-batch ("passes") and the step's clipping, AdamW update and zeroing of the
    gradients ("tail"); the Trainers are timed in alternation."""
    import torch
    import torch.distributed as dist

    import tessera.parallel.tensor.comm as tp_comm

    strategies = {"dp": "dp=2,mbs=1,gbs=2", "tp": "dp=1,tp=2,mbs=1,gbs=1"}
    with tempfile.TemporaryDirectory() as folder:
        trainers = _tiny_trainers(folder, strategies)
        _silence(tp_comm.TPGroup)  # this process only
        for (kind, _), trainer in trainers.items():
            if kind == "dp":
                trainer.plan.module.register_comm_hook(None, _no_all_reduce)
        best = {(kind, depth, part): float("inf") for kind, depth in trainers
                for part in ("passes", "tail")}
        for round_ in range(rounds + 2):  # two warm-up rounds
            for (kind, depth), trainer in trainers.items():
                batch = trainer.data_collator([trainer.train_dataset[0]])
                dist.barrier()
                start = time.perf_counter()
                trainer.engine.forward_backward([batch])
                passes = time.perf_counter() - start
                start = time.perf_counter()
                trainer.plan.clip_grad_norm(trainer.model, 1.0)
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                tail = time.perf_counter() - start
                if round_ >= 2:
                    for part, seconds in (("passes", passes), ("tail", tail)):
                        best[(kind, depth, part)] = min(best[(kind, depth, part)], seconds)
    return best


def _worker_2d(rank: int, world: int, rounds: int) -> dict:
    """This rank's fastest forward and backward of one micro-batch through the Engine at
    tp=4, tp_mode=2d (collectives no-ops), for each depth; one rank at a time."""
    import torch.distributed as dist

    import tessera.parallel.tensor.comm as tp_comm

    with tempfile.TemporaryDirectory() as folder:
        trainers = _tiny_trainers(folder, {"tp2d": "dp=1,tp=4,tp_mode=2d,mbs=2,gbs=2"})
        _silence(tp_comm.TPGroup)
        best = {(kind, depth, "passes"): float("inf") for kind, depth in trainers}
        for round_ in range(rounds + 2):  # two warm-up rounds
            for (kind, depth), trainer in trainers.items():
                # Two sequences: one for each grid row, as the 1D runs' one per rank.
                batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
                for turn in range(world):
                    dist.barrier()
                    if turn == rank:
                        start = time.perf_counter()
                        trainer.engine.forward_backward([batch])
                        seconds = time.perf_counter() - start
                        trainer.optimizer.zero_grad(set_to_none=True)
                        if round_ >= 2:
                            key = (kind, depth, "passes")
                            best[key] = min(best[key], seconds)
                dist.barrier()
    return best


def _tiny_trainers(folder: str, strategies: dict[str, str]) -> dict:
    """A Trainer of a tiny reference transformer for each (kind, depth)."""
    import torch

    from tessera.config import TrainingArguments
    from tessera.models import Transformer
    from tessera.models.config import ModelConfig
    from tessera.strategy import Strategy
    from tessera.train.trainer import Trainer

    args = TrainingArguments(output_dir=folder, max_steps=10**6, warmup_steps=0,
                             progress="off", device="cpu", logging_steps=10**6)
    trainers = {}
    for kind, text in strategies.items():
        for depth in DEPTHS:
            config = ModelConfig(n_layers=depth, d_model=8, n_heads=2, vocab_size=16,
                                 max_seq_len=4)
            gen = torch.Generator().manual_seed(0)
            rows = torch.randint(0, 16, (8, 5), generator=gen)
            data = [{"input_ids": r[:-1], "labels": r[1:]} for r in rows]
            torch.manual_seed(0)
            trainers[(kind, depth)] = Trainer(Transformer(config), args, data,
                                              strategy=Strategy.parse(text))
    return trainers


def _silence(group_type) -> None:
    """Make a tensor-parallel group's collectives no-ops in this process, keeping shapes
    (the values are wrong; only the time of what surrounds them is measured)."""
    import torch

    group_type.all_reduce = lambda self, tensor, op=None: tensor
    group_type.broadcast = lambda self, tensor, src: tensor
    group_type.reduce = lambda self, tensor, dst: tensor
    group_type.all_gather = lambda self, tensor, dim: torch.cat([tensor] * self.size, dim=dim)
    group_type.reduce_scatter = lambda self, tensor, dim: tensor.chunk(self.size, dim)[
        self.rank].contiguous()


def _no_all_reduce(state, bucket):
    """DDP communication hook that leaves each bucket as it is (a no-op all-reduce)."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
