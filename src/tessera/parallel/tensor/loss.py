"""Cross-entropy over vocabulary-sharded logits, the per-rank loss, and TP gradient clipping.

No rank ever holds the full-vocabulary logits: the softmax normaliser and the target logit are
sums over the vocabulary, so each rank reduces its slice and the group all-reduces three
numbers per token in two messages (the max; then the sum of exponentials with the target
logit).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch import nn

from tessera.parallel.plan import Batch, causal_lm_logits
from tessera.parallel.tensor.comm import Grid, ReduceFromTP, TPGroup

IGNORE_INDEX = -100


class VocabParallelCrossEntropyFn(torch.autograd.Function):
    """Per-token loss (N,) from logits (N, V/p) holding vocabulary rows [start, start + V/p)."""

    @staticmethod
    def forward(ctx, logits, labels, group: TPGroup):
        logits = logits.float()
        width = logits.shape[-1]
        start = group.rank * width
        # The max only stabilises exp(); any value equal on all ranks gives the same loss.
        top = group.all_reduce(logits.max(-1).values, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - top[:, None]  # (N, V/p)
        exp = shifted.exp()
        local = labels - start
        mine = (local >= 0) & (local < width)
        safe = local.masked_fill(~mine, 0)
        target = shifted.gather(1, safe[:, None]).squeeze(1).masked_fill(~mine, 0.0)
        # Both sums in one message: (2, N) = sum of exponentials, target logit. ``total`` is
        # saved for backward: its own copy, not a view holding both rows.
        sums = group.all_reduce(torch.stack([exp.sum(-1), target]))
        total, target = sums[0].clone(), sums[1]
        ignored = labels == IGNORE_INDEX
        loss = (total.log() - target).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp, total, safe, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, total, safe, mine, ignored = ctx.saved_tensors
        g = grad.masked_fill(ignored, 0.0)  # (N,)
        grad_logits = exp / total[:, None] * g[:, None]  # softmax * dloss
        rows = torch.arange(len(safe), device=safe.device)[mine]
        grad_logits[rows, safe[mine]] -= g[mine]
        return grad_logits, None, None


def sharded_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab: TPGroup,
                    batch: TPGroup | None = None) -> torch.Tensor:
    """Mean next-token loss from logits (B, T, V/p) split over ``vocab``.

    Args:
        logits: this rank's vocabulary slice of the logits of its samples.
        labels: (B, T) labels of the same samples; -100 is ignored.
        vocab: the ranks holding the other vocabulary slices.
        batch: under 2D, the ranks holding the other batch slices: the mean is taken over all.
    """
    per_token = VocabParallelCrossEntropyFn.apply(logits.flatten(0, 1), labels.flatten(), vocab)
    total, count = per_token.sum(), (labels != IGNORE_INDEX).sum().float()
    if batch is not None and batch.size > 1:
        # Every rank then holds the mean of the whole micro-batch; the identity backward gives
        # each share its own gradient.
        total = ReduceFromTP.apply(total, batch)
        count = batch.all_reduce(count.clone())
    return total / count.clamp_min(1)  # no labels: 0, as lm_loss


def make_forward_loss_1d(group: TPGroup):
    """``forward_loss`` of 1D tensor parallelism: vocabulary-parallel cross-entropy."""

    def forward_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        logits = causal_lm_logits(module, batch["input_ids"])  # (B, T, V/tp)
        return sharded_lm_loss(logits, batch["labels"], group)

    return forward_loss


def make_forward_loss_2d(grid: Grid):
    """``forward_loss`` of 2D: this grid row's batch slice in, loss over the micro-batch out."""

    def forward_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"].chunk(grid.q, dim=0)[grid.i]  # (B/q, T)
        labels = batch["labels"].chunk(grid.q, dim=0)[grid.i]
        logits = causal_lm_logits(module, ids)  # (B/q, T, V/q)
        return sharded_lm_loss(logits, labels, grid.row, grid.col)

    return forward_loss


def make_clip_grad_norm(group: TPGroup):
    """``clip_grad_norm`` over DTensor shards: replicas are counted once."""

    def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # On the parameters' device even when this rank holds no gradient: NCCL reduces
        # device tensors only.
        device = next(model.parameters(), torch.empty(0)).device
        square = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            copies = replica_count(g, group.size)
            square = square + local.float().pow(2).sum().to(device) / copies
        group.all_reduce(square)
        norm = square.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
        return norm

    return clip_grad_norm


def replica_count(grad: torch.Tensor, tp: int) -> int:
    """How many ranks of the tp group hold the same piece of this gradient."""
    if not isinstance(grad, DTensor):
        return tp  # a plain tensor under tensor parallelism is whole on every rank
    mesh = grad.device_mesh
    return math.prod(mesh.size(d) for d, p in enumerate(grad.placements)
                     if isinstance(p, Replicate))
