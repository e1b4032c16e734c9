"""Pipeline stages of a tensor-parallel model (1D or 2D): the loss, the norm group, layouts.

Tensor parallelism runs first (``parallelize``): its layers then use custom ops
(``tensor/ops.py`` for 1D, ``tensor/ops2d.py`` for 2D SUMMA), which ``torch.export`` keeps as
graph nodes with their backward, so the partitioner cuts a sharded model like any other.
What the pipeline adds:

- the last stage's logits are split over the vocabulary (B, T, V/tp), or under 2D over the
  vocabulary and the batch (B/q, T, V/q): the loss is the vocabulary-parallel cross-entropy,
  not ``lm_loss``;
- under 2D, grid row i reads batch slice i of every micro-batch (:class:`GridInputs`), so the
  stages are captured at B/q rows, and the loss is the mean over the whole micro-batch;
- the gradient norm sums shards over the tp group (``GradSync(tp_group=...)``), counting a
  piece replicated over grid rows (2D biases and norm weights) once;
- fused q|k|v weights are stored permuted; the hooks that save them unpermuted live on the
  tensor-parallel modules, so this rank's ``StageModule`` gets the same hooks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.parallel.tensor.comm import Grid, TPGroup
from tessera.parallel.tensor.loss import sharded_lm_loss
from tessera.parallel.tensor.shard import add_unpermute_hooks
from tessera.strategy import Strategy


def tp_group_of(strategy: Strategy, mesh: Mesh):
    """The tp process group (all q*q ranks under 2D) when parameters are shards, else None."""
    return mesh.group("tp") if strategy.tp > 1 else None


def tp_loss(strategy: Strategy, mesh: Mesh
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(logits (B, T, V/tp), labels (B, T)) -> mean loss`` for 1D tensor parallelism."""
    if strategy.tp == 1 or strategy.tp_mode == "2d":
        return None  # 2D: GridInputs.loss
    group = TPGroup(mesh.group("tp"))
    return lambda logits, labels: sharded_lm_loss(logits, labels, group)


def stage_batch(strategy: Strategy) -> int:
    """Rows of a micro-batch one rank's stages run: mbs, or mbs / q under 2D."""
    if strategy.tp > 1 and strategy.tp_mode == "2d":
        return strategy.micro_batch_size // strategy.tp_grid[0]
    return strategy.micro_batch_size


class GridInputs:
    """What the pipeline asks of 2D tensor parallelism (the interface of sequence
    parallelism's ``StageInputs``): this grid row's batch slice in, the micro-batch's loss out.

    Args:
        grid: this rank's q x q grid.
    """

    example = None  # the captured model reads input_ids only

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def shard(self, batch: dict[str, torch.Tensor], training: bool = True
              ) -> dict[str, torch.Tensor]:
        """Batch slice i (rows [i B/q, (i+1) B/q)) of every tensor of the micro-batch, for
        training and evaluation alike."""
        q, rows = self.grid.q, batch["input_ids"].shape[0]
        if rows % q:
            raise ValueError(f"2D tensor parallelism splits each batch over the {q} grid rows: "
                             f"a batch of {rows} rows is not divisible by {q}")
        return {k: v.chunk(q, dim=0)[self.grid.i] for k, v in batch.items()}

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss over the whole micro-batch from logits (B/q, T, V/q), on every rank."""
        return sharded_lm_loss(logits, batch["labels"], self.grid.row, self.grid.col)


def grid_inputs(strategy: Strategy, mesh: Mesh) -> GridInputs | None:
    """:class:`GridInputs` under 2D tensor parallelism, else None."""
    if strategy.tp > 1 and strategy.tp_mode == "2d":
        return GridInputs(Grid.from_mesh(mesh))
    return None


def carry_permutations(model: nn.Module, stage: nn.Module) -> None:
    """Give ``stage`` the unpermute-on-save hooks of the model's permuted parameters."""
    held = {id(p): name for name, p in stage.named_parameters(remove_duplicate=False)}
    for module in model.modules():
        for leaf, (dim, perm) in getattr(module, "tp_permuted", {}).items():
            name = held.get(id(getattr(module, leaf)))
            if name is None:
                continue  # another stage holds it
            owner = stage.get_submodule(name.rpartition(".")[0])
            add_unpermute_hooks(owner, leaf, dim, perm)
