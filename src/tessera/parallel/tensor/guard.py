"""Refuse calls of a tensor-parallel model outside tessera's own loss.

Under tensor parallelism the user's model keeps its modules' names but holds this rank's
shards, and its output layer gives this rank's vocabulary slice of the logits (the loss is
computed over the slices, loss.py). Called directly (``model(ids)``, ``generate``, a
Hugging Face loss from ``labels``) it would return a slice as if it were the whole: a
different token on each rank, or a shape error far from the cause. Such a call is refused,
naming the way out; tessera's own calls (training and evaluation, through the plan's
``forward_loss``) and torch.export captures of the model (pipeline stages) go through.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.strategy import Strategy


class ShardedModelError(RuntimeError):
    """The model holds this rank's tensor-parallel shards: a direct call gives a slice."""


def guard_direct_calls(plan, strategy: Strategy) -> None:
    """Make calls of ``plan.model`` outside ``plan.forward_loss`` raise ShardedModelError."""
    model: nn.Module = plan.model
    inner = plan.forward_loss
    depth = [0]  # calls of forward_loss under way on this rank

    def forward_loss(module: nn.Module, batch):
        depth[0] += 1
        try:
            return inner(module, batch)
        finally:
            depth[0] -= 1

    def refuse(_module, _args, _kwargs):
        if depth[0] or torch.compiler.is_exporting():
            return
        raise ShardedModelError(
            f"this model is laid out over tp={strategy.tp} tensor-parallel ranks "
            f"(tp_mode={strategy.tp_mode}): each rank holds its shards, and a call outside "
            "tessera's training and evaluation would give this rank's slice of the "
            "vocabulary as the logits; write the whole model with trainer.save_model(dir) "
            "and load it back (from_pretrained, tessera.train.export.load_reference_model, "
            "or train.init_from) to call it")

    plan.forward_loss = forward_loss
    model.register_forward_pre_hook(refuse, with_kwargs=True)
