"""2D (Optimus) layers on the q x q grid, as autograd functions with their own backward.

Layout. An activation (B, T, C) is cut in both dimensions: rank (i, j) holds batch slice i and
feature slice j, (B/q, T, C/q). A weight is cut in both of its dimensions: rank (r, c) holds
block (r, c). A vector over features (bias, norm weight) is cut by grid column and kept whole
along the column, so its gradient is summed over the grid column (the batch slices).

- ``Linear2DFn``: nn.Linear weight (O, C): forward C = X W^T (summa abt), backward
  dX = dY W (ab), dW = dY^T X (atb).
- ``Conv1D2DFn``: GPT-2 Conv1D weight (C, O): forward X W (ab), backward dY W^T (abt),
  X^T dY (atb).
- ``AddBias2DFn``, ``Norm2DFn`` (layernorm / rmsnorm: statistics summed along the grid row),
  ``Embedding2DFn`` (lookup as a SUMMA product with a one-hot left operand that is never
  built: only the weight blocks travel).

Attention needs nothing of its own: the q/k/v projections' output feature slice j is a group
of whole heads, so each rank attends over its batch slice with its heads (Optimus, sec. 3.3).
"""

from __future__ import annotations

import torch

from tessera.parallel.tensor.comm import Grid
from tessera.parallel.tensor.summa import summa_ab, summa_abt, summa_atb


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Linear2DFn(torch.autograd.Function):
    """Y = X W^T for an nn.Linear weight; ``weight`` is this rank's (O/q, C/q) block."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.save_for_backward(x, weight)  # (B/q, T, C/q): 1/q^2 of the activation
        ctx.grid = grid
        y = summa_abt(_flat(x), weight, grid)  # (B/q*T, O/q)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = _flat(grad.contiguous())  # (B/q*T, O/q)
        grad_x = summa_ab(g, weight, ctx.grid).view_as(x)
        grad_w = summa_atb(g, _flat(x), ctx.grid)  # (O/q, C/q)
        return grad_x, grad_w, None


class Conv1D2DFn(torch.autograd.Function):
    """Y = X W for a GPT-2 Conv1D weight; ``weight`` is this rank's (C/q, O/q) block."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        y = summa_ab(_flat(x), weight, grid)  # (B/q*T, O/q)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = _flat(grad.contiguous())
        grad_x = summa_abt(g, weight, ctx.grid).view_as(x)
        grad_w = summa_atb(_flat(x), g, ctx.grid)  # (C/q, O/q)
        return grad_x, grad_w, None


class AddBias2DFn(torch.autograd.Function):
    """y = x + b with b this column's feature slice, shared by the grid column."""

    @staticmethod
    def forward(ctx, x, bias, grid: Grid):
        ctx.grid = grid
        return x + bias

    @staticmethod
    def backward(ctx, grad):
        # Each grid row saw its own batch slice: the shared bias sums them all.
        grad_b = ctx.grid.col.all_reduce(_flat(grad).sum(0))
        return grad, grad_b, None


class Norm2DFn(torch.autograd.Function):
    """LayerNorm (``bias`` may be None) or RMSNorm (``rms=True``) over features split by column.

    Statistics are sums over the whole feature dim: local sums, then an all-reduce along the
    grid row. Computed in fp32 like the single-device norms.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, features: int, grid: Grid):
        x32 = x.float()  # (B/q, T, C/q)
        if rms:
            centred = x32
        else:
            mean = grid.row.all_reduce(x32.sum(-1, keepdim=True)) / features
            centred = x32 - mean
        var = grid.row.all_reduce(centred.pow(2).sum(-1, keepdim=True)) / features
        rstd = torch.rsqrt(var + eps)
        xhat = centred * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.rms, ctx.features, ctx.grid, ctx.has_bias = rms, features, grid, bias is not None
        y = xhat.type_as(x) * weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        grid, n = ctx.grid, ctx.features
        g = grad.float() * weight.float()  # d loss / d xhat
        proj = grid.row.all_reduce((g * xhat).sum(-1, keepdim=True)) / n
        inner = g - xhat * proj
        if not ctx.rms:
            inner = inner - grid.row.all_reduce(g.sum(-1, keepdim=True)) / n
        grad_x = (inner * rstd).to(grad.dtype)
        grad_w = grid.col.all_reduce(_flat(grad.float() * xhat).sum(0)).to(weight.dtype)
        grad_b = grid.col.all_reduce(_flat(grad).sum(0)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


class Embedding2DFn(torch.autograd.Function):
    """Lookup of ``ids`` (this rank's batch slice) in a (V, C) table cut into q x q blocks.

    Output block (i, j) = sum_k onehot(ids_i)[:, V_k] W_kj: step k broadcasts W_kj down
    column j and each rank picks the rows of its ids that fall in V_k. Backward scatters the
    output gradient into a (V/q, C/q) block per step and reduces it down the column to (k, j).
    """

    @staticmethod
    def forward(ctx, ids, weight, grid: Grid):
        rows = weight.shape[0]  # V/q
        out = None
        for k in range(grid.q):
            block = grid.col.broadcast(weight.contiguous() if grid.i == k
                                       else torch.empty_like(weight), src=k)  # W_kj
            local_ids = ids - k * rows
            outside = (local_ids < 0) | (local_ids >= rows)
            part = block[local_ids.masked_fill(outside, 0)].masked_fill(outside[..., None], 0.0)
            out = part if out is None else out + part  # (..., C/q)
        ctx.save_for_backward(ids)
        ctx.grid, ctx.shape = grid, weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grid, (rows, cols) = ctx.grid, ctx.shape
        flat_ids, g = ids.reshape(-1), _flat(grad)
        grad_w = None
        for k in range(grid.q):
            local_ids = flat_ids - k * rows
            inside = (local_ids >= 0) & (local_ids < rows)
            part = g.new_zeros(rows, cols)
            part.index_add_(0, local_ids[inside], g[inside])
            grid.col.reduce(part, dst=k)
            if grid.i == k:
                grad_w = part
        return None, grad_w, None
