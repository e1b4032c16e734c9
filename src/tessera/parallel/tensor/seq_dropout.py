"""Dropout on a tp rank's sequence chunk under Megatron sequence parallelism.

Between layers Megatron sequence parallelism splits the activation along the sequence: rank r
of t holds tokens [r T/t, (r + 1) T/t) of every sample, (B, T/t, C). tp peers draw from one
random stream (parallel/rank_rng.py: their replicated regions need equal masks), so plain
dropout would drop every rank's chunk with the same mask. Megatron forks a second generator
per rank for these regions; that gives valid masks but not one device's.

:class:`SequenceChunkDropout` draws the whole (B, T, C) mask from the shared stream, as one
device's dropout would draw it for the whole activation, and keeps this rank's T/t rows. The
peers draw the same mask and stay in step, each chunk is dropped as one device drops those
tokens (equal under one seed, tested against one device), and the stream advances as one
device's. The cost: each dropout draws the whole mask (a transient (B, T, C) tensor, freed
before the chunk's mask is kept) where Megatron draws 1/t of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.parallel.tensor.comm import TPGroup


class SequenceChunkDropout(nn.Module):
    """``nn.Dropout(p)`` for activations split along dim 1 over ``group`` (Megatron sequence
    parallelism): this rank's rows of the mask one device draws for the whole sequence."""

    def __init__(self, p: float, group: TPGroup) -> None:
        super().__init__()
        self.p, self.group = p, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T/t, ...)
        # A pipeline stage's eval capture must hold the ops of the training capture its
        # partition names (pipeline/program.py), as nn.Dropout's own node stays in an eval
        # capture: while exporting, eval multiplies by ones all the same.
        if self.p == 0 or not (self.training or torch.compiler.is_exporting()):
            return x
        rows = x.shape[1]
        whole = (x.shape[0], rows * self.group.size, *x.shape[2:])
        # F.dropout of ones is the scaled keep mask (0 or 1/(1-p)) dropout multiplies by,
        # drawn in the same order and dtype as one device's dropout of the whole activation.
        ones = torch.ones(whole, dtype=x.dtype, device=x.device)
        noise = F.dropout(ones, self.p, self.training)
        mine = noise.narrow(1, self.group.rank * rows, rows).contiguous()  # (B, T/t, ...)
        return x * mine

    def extra_repr(self) -> str:
        return f"p={self.p}, sequence chunk {self.group.rank} of {self.group.size}"


def shard_sequence_dropouts(model: nn.Module, group: TPGroup) -> None:
    """Replace every ``nn.Dropout`` of ``model`` (whose inputs Megatron sequence parallelism
    splits along the sequence: the reference model's embedding and residual dropout) with a
    :class:`SequenceChunkDropout`."""
    for path, module in list(model.named_modules()):
        if type(module) is nn.Dropout and module.p > 0:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name,
                    SequenceChunkDropout(module.p, group))
