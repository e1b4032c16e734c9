"""1D (Megatron) tensor parallelism: column/row-parallel linear, vocabulary-parallel embedding.

Activations are whole on every rank of the tp group (or, with Megatron sequence parallelism,
split along the sequence between the layers). A column-parallel linear holds a slice of the
output features, a row-parallel one a slice of the input features; a column layer followed by
a row layer needs one all-reduce forward (after the row layer) and one backward (before the
column layer; the column layers reading one block input share it: ``modules.BlockInput``).
With sequence parallelism those become an all-gather before the column layer and a
reduce-scatter after the row layer: the same bytes, but norms and dropout in between work on
1/tp of the sequence.

Weights are given as (out, in) local tensors; a Conv1D (GPT-2) weight is passed transposed.
Shapes: N tokens (B*T flattened in the functions), C in features, O out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.parallel.tensor.comm import TPGroup


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _in_dtype(dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The saved operands in the dtype the forward product ran in.

    Under autocast the forward's F.linear cast fp32 weights (and inputs) to bf16/fp16, but a
    custom backward runs outside autocast on the saved originals: the products are cast here
    as autocast's own linear backward computes them (in the low dtype). Autograd then casts
    each gradient to its input's dtype (fp32 for the weights).
    """
    return tuple(t.to(dtype) for t in tensors)


class ColumnLinearFn(torch.autograd.Function):
    """y = x w^T + b with w holding O/tp output rows.

    ``mode`` says where the input gradient's sum over ranks happens:
    "replicated": x is whole on every rank; all-reduce the input gradient here (Megatron f).
        Used by the output layer, the only column layer outside a block.
    "gather": x is a sequence slice (SP); all-gather it here, reduce-scatter the gradient.
    "gathered": the enclosing attention / MLP block applied f to x (or, under SP, gathered
        it) once for all its column layers; that op's backward sums, so nothing here does.
        Under SP, ``gathered`` is (the rank's shard, its :class:`GatheredInput`): the shard
        is kept and gathered again in backward, once for the block's column layers.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group: TPGroup, mode: str, gathered=None):
        # x: (B, T, C) or (B, T/tp, C) for "gather"; weight: (O/tp, C)
        full = group.all_gather(x, dim=1) if mode == "gather" else x  # (B, T, C)
        ctx.source = None if gathered is None else gathered[1]
        if ctx.source is not None:  # keep the shard (B, T/tp, C), not the gathered x
            ctx.save_for_backward(gathered[0], weight)
            ctx.source.readers += 1
        else:  # "gather" saves the slice and gathers it again
            ctx.save_for_backward(x, weight)
        ctx.group, ctx.mode, ctx.has_bias = group, mode, bias is not None
        y = F.linear(full, weight, bias)  # (B, T, O/tp)
        ctx.dtype = y.dtype  # autocast's, when it is on
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = _in_dtype(ctx.dtype, *ctx.saved_tensors)
        grad = grad.to(ctx.dtype)
        gather = ctx.mode == "gather"
        if ctx.source is not None:
            full = ctx.source.gather(x)  # (B, T, C), gathered once for the block's columns
        else:
            full = ctx.group.all_gather(x, dim=1) if gather else x
        grad_x = grad @ weight  # (B, T, C): this rank's part of the sum over output features
        if gather:
            grad_x = ctx.group.reduce_scatter(grad_x, dim=1)
        elif ctx.mode == "replicated":
            grad_x = ctx.group.all_reduce(grad_x.contiguous())
        grad_w = _flat(grad).t() @ _flat(full)  # (O/tp, C)
        grad_b = _flat(grad).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


class RowLinearFn(torch.autograd.Function):
    """y = sum over ranks (x_r w_r^T) + b with x and w split along the input features."""

    @staticmethod
    def forward(ctx, x, weight, bias, group: TPGroup, seq_parallel: bool):
        # x: (B, T, C/tp); weight: (O, C/tp); bias whole
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.has_bias = group, seq_parallel, bias is not None
        partial = F.linear(x, weight)  # (B, T, O), a partial sum
        ctx.dtype = partial.dtype  # autocast's, when it is on
        y = group.reduce_scatter(partial, dim=1) if seq_parallel else group.all_reduce(partial)
        # The bias in the product's dtype, as nn.Linear adds it under autocast: an fp32 bias
        # promoted a bf16 output to fp32 (unlike one device; its dropout noise too).
        return y if bias is None else y + bias.to(y.dtype)  # (B, T, O) or (B, T/tp, O)

    @staticmethod
    def backward(ctx, grad):
        x, weight = _in_dtype(ctx.dtype, *ctx.saved_tensors)
        grad = grad.to(ctx.dtype)
        grad_b = None
        if ctx.has_bias:
            grad_b = _flat(grad).sum(0)
            if ctx.sp:  # each rank saw 1/tp of the tokens: sum them for the shared bias
                grad_b = ctx.group.all_reduce(grad_b)
        full = ctx.group.all_gather(grad, dim=1) if ctx.sp else grad  # (B, T, O)
        grad_x = full @ weight  # (B, T, C/tp)
        grad_w = _flat(full).t() @ _flat(x)  # (O, C/tp)
        return grad_x, grad_w, grad_b, None, None


class VocabEmbeddingFn(torch.autograd.Function):
    """Embedding with the vocabulary split over ranks: local lookup, then sum over ranks."""

    @staticmethod
    def forward(ctx, ids, weight, group: TPGroup, seq_parallel: bool):
        # ids: (B, T); weight: (V/tp, C) rows [start, start + V/tp)
        start = group.rank * weight.shape[0]
        local_ids = ids - start
        outside = (local_ids < 0) | (local_ids >= weight.shape[0])
        local_ids = local_ids.masked_fill(outside, 0)
        out = weight[local_ids].masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C) partial
        out = group.reduce_scatter(out, dim=1) if seq_parallel else group.all_reduce(out)
        ctx.save_for_backward(local_ids, outside)
        ctx.group, ctx.sp, ctx.rows = group, seq_parallel, weight.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        local_ids, outside = ctx.saved_tensors
        full = ctx.group.all_gather(grad, dim=1) if ctx.sp else grad  # (B, T, C)
        full = full.masked_fill(outside.unsqueeze(-1), 0.0)
        grad_w = full.new_zeros(ctx.rows, full.shape[-1])
        grad_w.index_add_(0, local_ids.reshape(-1), _flat(full))
        return None, grad_w, None, None
