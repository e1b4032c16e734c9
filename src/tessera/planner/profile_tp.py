"""What a 1D tensor-parallel layer costs beyond a plain one, for ``tessera profile``.

Two workers train a tiny reference transformer (arithmetic negligible) at tp=2 with the
tensor-parallel collectives made no-ops (the numbers are wrong; the Python, the autograd
functions and DTensor's dispatch are not), and the same model as plain dp=2, each at 1 and at
5 layers. The per-layer differences give the tp layer's own overhead per micro-batch (its
forward and backward) and per step (AdamW over DTensor parameters). The collectives
themselves are priced from the measured fits, as for every other layout.
"""

from __future__ import annotations

import tempfile
import time

DEPTHS = (1, 5)  # five layers against one: the per-layer part is a difference of 4 layers


def measure_tp_overheads(rounds: int = 12) -> dict[str, float]:
    """``tp_layer`` (seconds per 1D tp layer and micro-batch beyond a plain layer's forward
    and backward) and ``tp_optim_layer`` (per layer and step, AdamW over its DTensor shards
    beyond the plain layer's update), at a lone worker's rate: two workers, each on its own
    core where the machine has two."""
    from tessera.testing import run_distributed

    best = run_distributed(_worker, world_size=2, args=(rounds,), timeout=600)[0]
    layers = DEPTHS[1] - DEPTHS[0]

    def per_layer(kind: str, part: str) -> float:
        return (best[(kind, DEPTHS[1], part)] - best[(kind, DEPTHS[0], part)]) / layers

    optim = {kind: per_layer(kind, "optim") for kind in ("tp", "dp")}
    passes = {kind: per_layer(kind, "step") - optim[kind] for kind in ("tp", "dp")}
    return {"tp_layer": max(0.0, passes["tp"] - passes["dp"]),
            "tp_optim_layer": max(0.0, optim["tp"] - optim["dp"])}


def _worker(rank: int, world: int, rounds: int) -> dict:
    """Fastest of ``rounds`` for each (kind, depth, part): a whole training step ("step")
    and its AdamW update alone ("optim"); the Trainers are timed in alternation."""
    import torch
    import torch.distributed as dist

    import tessera.parallel.tensor.comm as tp_comm
    from tessera.config import TrainingArguments
    from tessera.models import Transformer
    from tessera.models.config import ModelConfig
    from tessera.strategy import Strategy
    from tessera.train.trainer import Trainer

    strategies = {"dp": "dp=2,mbs=1,gbs=2", "tp": "dp=1,tp=2,mbs=1,gbs=1"}
    with tempfile.TemporaryDirectory() as folder:
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
        tp_comm.TPGroup.all_reduce = lambda self, tensor, op=None: tensor  # this process only
        best = {(kind, depth, part): float("inf") for kind, depth in trainers
                for part in ("step", "optim")}
        for round_ in range(rounds + 2):  # two warm-up rounds
            for (kind, depth), trainer in trainers.items():
                dist.barrier()
                start = time.perf_counter()
                trainer._train_step()
                step = time.perf_counter() - start
                for param in trainer.model.parameters():
                    param.grad = torch.zeros_like(param)
                start = time.perf_counter()
                trainer.optimizer.step()
                optim = time.perf_counter() - start
                if round_ >= 2:
                    best[(kind, depth, "step")] = min(best[(kind, depth, "step")], step)
                    best[(kind, depth, "optim")] = min(best[(kind, depth, "optim")], optim)
    return best
