"""What a tensor-parallel layer costs beyond a plain one, for ``tessera profile``.

Workers train a tiny reference transformer (arithmetic negligible) with the tensor-parallel
collectives made no-ops (the numbers are wrong; the Python, the autograd functions and
DTensor's dispatch are not), each at 1 and at 5 layers, beside the same model unwrapped on
one process (the plain step ``tessera profile`` times for ``layer_fwd``/``layer_bwd``). The
per-layer differences give a tp layer's own overhead per micro-batch (the Engine's forward
and backward) and per step (the plan's gradient clipping and AdamW over DTensor parameters):

- 1D: two workers at tp=2, timed together, each on its own core where the machine has two;
- 2D (SUMMA): four workers on a 2 x 2 grid (tp=4, tp_mode=2d). With the collectives no-ops
  no rank waits for another, so each rank is timed in turn while the others wait in a
  barrier, at a lone worker's rate like the 1D figures; the slowest rank's figure is kept.

The collectives themselves are priced from the measured fits, as for every other layout.
What the figures leave out: the model-level part of a tp step (embedding, head and loss
beyond the plain model's) cancels in the depth difference and is not charged; the 2D figure
is measured at q = 2 and charged at any grid, though its loops run q steps per product.
"""

from __future__ import annotations

import tempfile
import time

DEPTHS = (1, 5)  # five layers against one: the per-layer part is a difference of 4 layers
LAYOUTS = {  # kind: (workers, strategy, sequences per micro-batch, ranks timed in turn)
    "tp": (2, "dp=1,tp=2,mbs=1,gbs=1", 1, False),
    # mbs=2: one sequence for each grid row, as each 1D rank has one
    "tp2d": (4, "dp=1,tp=4,tp_mode=2d,mbs=2,gbs=2", 2, True),
}
PARTS = ("passes", "tail")


def measure_tp_overheads(rounds: int = 12, layouts: tuple[str, ...] = tuple(LAYOUTS)
                         ) -> dict[str, float]:
    """Seconds beyond a plain layer's, at a lone worker's rate, for each of ``layouts``:
    "tp" gives ``tp_layer`` per 1D tp layer and micro-batch (forward and backward) and
    ``tp_optim_layer`` per 1D layer and step (clipping and AdamW over its DTensor shards);
    "tp2d" gives ``tp2d_layer`` and ``tp2d_optim_layer`` likewise for a 2D layer (four
    workers)."""
    from tessera.testing import run_distributed

    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"unknown tensor-parallel layouts {sorted(unknown)}; "
                         f"known: {sorted(LAYOUTS)}")
    figures = {}
    for kind in layouts:
        workers = LAYOUTS[kind][0]
        ranks = run_distributed(_worker, world_size=workers, args=(kind, rounds),
                                timeout=600, collective_timeout_s=120)
        figures.update({f"{kind}_layer": _per_layer(ranks, kind, "passes"),
                        f"{kind}_optim_layer": _per_layer(ranks, kind, "tail")})
    return figures


def _per_layer(ranks: list[dict], kind: str, part: str) -> float:
    """Per-layer seconds of ``kind`` over the plain model in ``part``, from each rank's
    fastest timings; the slowest rank's (a synchronous step waits for it), never below 0."""
    layers = DEPTHS[1] - DEPTHS[0]

    def slope(best: dict, k: str) -> float:
        return (best[(k, DEPTHS[1], part)] - best[(k, DEPTHS[0], part)]) / layers

    return max(0.0, max(slope(best, kind) - slope(best, "plain") for best in ranks))


def _worker(rank: int, world: int, kind: str, rounds: int) -> dict:
    """Fastest of ``rounds`` for each (kind or "plain", depth, part): the Engine's forward and
    backward of one micro-batch ("passes") and the step's clipping, AdamW update and zeroing
    of the gradients ("tail"), for ``kind``'s Trainers and the unwrapped model alike, timed in
    alternation (``kind``'s ranks one at a time where the layout says so)."""
    import torch
    import torch.distributed as dist

    import tessera.parallel.tensor.comm as tp_comm
    from tessera.planner.profile import _tiny_step

    _, strategy, sequences, in_turn = LAYOUTS[kind]
    torch.set_flush_denormal(True)  # silenced broadcasts leave garbage in the blocks
    with tempfile.TemporaryDirectory() as folder:
        steps = {}
        for (k, depth), trainer in _tiny_trainers(folder, kind, strategy).items():
            batch = trainer.data_collator([trainer.train_dataset[i] for i in range(sequences)])
            steps[(k, depth)] = _trainer_parts(trainer, batch)
        for depth in DEPTHS:
            _, forward_backward, optimizer = _tiny_step(depth)
            steps[("plain", depth)] = (forward_backward, optimizer)
        _silence(tp_comm.TPGroup)  # this process only
        best = {(k, depth, part): float("inf") for k, depth in steps for part in PARTS}
        turns = range(world) if in_turn else (rank,)
        for round_ in range(rounds + 2):  # two warm-up rounds
            for (k, depth), parts in steps.items():
                for turn in turns:
                    dist.barrier()
                    if turn != rank:
                        continue
                    for part, fn in zip(PARTS, parts):
                        start = time.perf_counter()
                        fn()
                        seconds = time.perf_counter() - start
                        if round_ >= 2:
                            best[(k, depth, part)] = min(best[(k, depth, part)], seconds)
                dist.barrier()
    return best


def _trainer_parts(trainer, batch) -> tuple:
    """(forward and backward of ``batch`` through the Engine, clip + AdamW + zero_grad)."""
    def passes():
        trainer.engine.forward_backward([batch])

    def tail():
        trainer.plan.clip_grad_norm(trainer.model, 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return passes, tail


def _tiny_trainers(folder: str, kind: str, strategy: str) -> dict:
    """A Trainer of a tiny reference transformer at ``strategy`` for each depth."""
    import torch

    from tessera.config import TrainingArguments
    from tessera.models import Transformer
    from tessera.models.config import ModelConfig
    from tessera.planner.validation import _synthetic_dataset
    from tessera.strategy import Strategy
    from tessera.train.trainer import Trainer

    args = TrainingArguments(output_dir=folder, max_steps=10**6, warmup_steps=0,
                             progress="off", device="cpu", logging_steps=10**6)
    trainers = {}
    for depth in DEPTHS:
        config = ModelConfig(n_layers=depth, d_model=8, n_heads=2, vocab_size=16, max_seq_len=4)
        data = _synthetic_dataset(8, config.max_seq_len, config.vocab_size)
        torch.manual_seed(0)
        trainers[(kind, depth)] = Trainer(Transformer(config), args, data,
                                          strategy=Strategy.parse(strategy))
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
