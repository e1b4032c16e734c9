"""Tensor-parallel shards of a meta-device model, materialised when the layout knows which.

A model built on meta and laid out with tensor parallelism gets its weights one transformer
block at a time (apply.py, FewAtATime). Under pipeline parallelism a rank keeps only its
stages' weights, which are known only once the pipeline has partitioned the graph; so there
each parameter becomes a DTensor whose local shard is still on meta, with a
:class:`ShardRecipe` saying how to cut it, and the pipeline asks :class:`PendingShards` to fill
the ones its stages hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tessera.models.materialize import FewAtATime, materialize_unit, parameter_aliases
from tessera.parallel.tensor.shard import make_param


@dataclass(frozen=True)
class ShardRecipe:
    """How one DTensor parameter is cut from the original (meta) parameter's whole value."""

    original: nn.Parameter  # the model's parameter before tensor parallelism, on meta
    mesh: object  # DeviceMesh of the tensor axes
    placements: tuple
    perm: torch.Tensor | None = None  # fused q|k|v rows reordered so each shard is contiguous
    perm_dim: int = 0

    def shard(self, whole: torch.Tensor) -> nn.Parameter:
        if self.perm is not None:
            whole = whole.index_select(self.perm_dim, self.perm.to(whole.device))
        return make_param(whole, self.mesh, self.placements, self.original.requires_grad)


class PendingShards:
    """The DTensor parameters of a tensor-parallel model whose shards are still on meta."""

    def __init__(self, source: FewAtATime, recipes: dict[int, ShardRecipe]) -> None:
        self.source, self.recipes = source, recipes  # recipes by id(DTensor parameter)

    def fill(self, model: nn.Module, names: Iterable[str]) -> list[str]:
        """Materialise the shards of the parameters named (any of a tied weight's names), one
        unit at a time (a transformer block's weights whole at once, materialize_unit); the
        others stay on meta. Returns the filled parameters' first names."""
        wanted, aliases = set(names), parameter_aliases(model)
        units: dict[str, list[int]] = {}  # unit -> ids of the named meta shards in it, in order
        seen: set[int] = set()
        for path, module in model.named_modules():
            for p in module.parameters(recurse=False):
                if id(p) in self.recipes and id(p) not in seen and wanted & set(aliases[id(p)]):
                    seen.add(id(p))
                    units.setdefault(materialize_unit(path), []).append(id(p))
        new: dict[int, nn.Parameter] = {}
        for ids in units.values():
            wholes = self.source.whole(self.recipes[key].original for key in ids)
            for key in ids:
                recipe = self.recipes[key]
                new[key] = recipe.shard(wholes[id(recipe.original)])
            del wholes  # before the next unit's request: one unit whole at a time
        for module in model.modules():  # tied: every holder gets the one shard
            for slot, p in module._parameters.items():
                if p is not None and id(p) in new:
                    module._parameters[slot] = new[id(p)]
        return [aliases[key][0] for key in new]
