"""Pipeline stages of a tensor-parallel (1D) model: the loss, the norm group, saved layouts.

Tensor parallelism runs first (``parallelize``): its 1D layers then use the custom-op
collectives of ``tensor/ops.py``, which ``torch.export`` keeps as graph nodes with their
backward, so the partitioner cuts a sharded model like any other. What the pipeline adds:

- the last stage's logits are split over the vocabulary (B, T, V/tp): the loss is the
  vocabulary-parallel cross-entropy, not ``lm_loss``;
- the gradient norm sums shards over the tp group (``GradSync(tp_group=...)``);
- fused q|k|v weights are stored permuted; the hooks that save them unpermuted live on the
  tensor-parallel modules, so this rank's ``StageModule`` gets the same hooks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.parallel.tensor.comm import TPGroup
from tessera.parallel.tensor.loss import sharded_lm_loss
from tessera.parallel.tensor.shard import add_unpermute_hooks
from tessera.strategy import Strategy


def tp_group_of(strategy: Strategy, mesh: Mesh):
    """The tp process group when parameters are shards, else None."""
    return mesh.group("tp") if strategy.tp > 1 else None


def tp_loss(strategy: Strategy, mesh: Mesh
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(logits (B, T, V/tp), labels (B, T)) -> mean loss`` for 1D tensor parallelism."""
    if strategy.tp == 1:
        return None
    group = TPGroup(mesh.group("tp"))
    return lambda logits, labels: sharded_lm_loss(logits, labels, group)


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
