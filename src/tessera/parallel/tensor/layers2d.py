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

The forward and backward of each layer are plain functions (``*_forward`` / ``*_backward``)
shared by the autograd functions here (eager training) and the ``torch.library`` custom ops
of ``ops2d.py`` (graphs captured for pipeline stages), so both paths compute the same thing.
"""

from __future__ import annotations

import torch

from tessera.parallel.tensor.comm import Grid
from tessera.parallel.tensor.summa import summa_ab, summa_abt, summa_atb


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------------------ linear
def product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a 2D linear's products run in: autocast's when it is on, else ``weight``'s."""
    device = x.device.type  # meta during capture, where autocast does not exist
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def autocast_operands(x: torch.Tensor, weight: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``weight`` in :func:`product_dtype` (a no-op without autocast when they
    already share it).

    SUMMA accumulates in place (``addmm_``) and borrows blocks into buffers shaped like its
    own operands, which autocast does not cast, so both operands must share one dtype.
    """
    dtype = product_dtype(x, weight)
    return x.to(dtype), weight.to(dtype)


def linear2d_forward(x: torch.Tensor, weight: torch.Tensor, grid: Grid,
                     conv1d: bool) -> torch.Tensor:
    """Block (i, j) of X W^T (nn.Linear weight block (O/q, C/q)) or X W (Conv1D, (C/q, O/q)).

    ``x`` and ``weight`` must share a dtype (:func:`autocast_operands`).
    """
    summa = summa_ab if conv1d else summa_abt
    y = summa(_flat(x), weight, grid)  # (B/q*T, O/q)
    return y.view(*x.shape[:-1], -1)


def linear2d_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grid: Grid,
                      conv1d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX block (B/q, T, C/q), dW block) from dY block (B/q, T, O/q).

    ``x`` is the input as the forward's products read it (:func:`saved_input`), so the
    backward's products run in its dtype, as autocast's own linear backward runs in the
    forward's; ``weight`` is the block as held and is cast here. Autograd casts each gradient
    to its input's dtype.
    """
    dtype = x.dtype
    g = _flat(grad.contiguous()).to(dtype)  # (B/q*T, O/q)
    w = weight.to(dtype)
    xf = _flat(x)  # (B/q*T, C/q)
    if conv1d:
        return summa_abt(g, w, grid).view_as(x), summa_atb(xf, g, grid)
    return summa_ab(g, w, grid).view_as(x), summa_atb(g, xf, grid)


def saved_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What a 2D linear keeps of its input for backward: ``x`` in :func:`product_dtype`.

    Under autocast that is the 16-bit copy the product read (half the bytes of an fp32
    input), as nn.Linear under autocast keeps; the weight block is kept as it is and cast
    again in backward, rather than keeping a 16-bit copy of it per micro-batch.
    """
    return x.to(product_dtype(x, weight))


class Linear2DFn(torch.autograd.Function):
    """Y = X W^T for an nn.Linear weight; ``weight`` is this rank's (O/q, C/q) block."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        x16, w16 = autocast_operands(x, weight)
        ctx.save_for_backward(x16, weight)  # (B/q, T, C/q): 1/q^2 of the activation
        ctx.grid = grid
        return linear2d_forward(x16, w16, grid, conv1d=False)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*linear2d_backward(grad, x, weight, ctx.grid, conv1d=False), None)


class Conv1D2DFn(torch.autograd.Function):
    """Y = X W for a GPT-2 Conv1D weight; ``weight`` is this rank's (C/q, O/q) block."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        x16, w16 = autocast_operands(x, weight)
        ctx.save_for_backward(x16, weight)
        ctx.grid = grid
        return linear2d_forward(x16, w16, grid, conv1d=True)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*linear2d_backward(grad, x, weight, ctx.grid, conv1d=True), None)


# -------------------------------------------------------------------------------- bias
def bias2d_grad(grad: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Gradient of a column-sliced bias: each grid row saw its own batch slice, so sum them."""
    # Summed in fp32: under autocast the gradient arrives in 16 bits.
    return grid.col.all_reduce(_flat(grad).sum(0, dtype=torch.float32))


def add_bias2d(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + b in ``x``'s dtype: under autocast nn.Linear adds its bias inside its 16-bit
    product, so a 16-bit product plus an fp32 bias stays 16-bit here too (promoting it would
    double what the next layer keeps, a GELU its input)."""
    return x + bias.to(x.dtype)


class AddBias2DFn(torch.autograd.Function):
    """y = x + b with b this column's feature slice, shared by the grid column."""

    @staticmethod
    def forward(ctx, x, bias, grid: Grid):
        ctx.grid = grid
        return add_bias2d(x, bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, bias2d_grad(grad, ctx.grid), None


# -------------------------------------------------------------------------------- norm
def norm2d_forward(x, weight, bias, eps: float, rms: bool, features: int, grid: Grid):
    """LayerNorm / RMSNorm of (B/q, T, C/q): returns (y, xhat fp32, rstd fp32 (B/q, T, 1))."""
    x32 = x.float()  # (B/q, T, C/q)
    if rms:
        centred = x32
    else:
        mean = grid.row.all_reduce(x32.sum(-1, keepdim=True)) / features
        centred = x32 - mean
    var = grid.row.all_reduce(centred.pow(2).sum(-1, keepdim=True)) / features
    rstd = torch.rsqrt(var + eps)
    xhat = centred * rstd
    y = xhat.type_as(x) * weight
    return (y if bias is None else y + bias), xhat, rstd


def norm2d_backward(grad, xhat, rstd, weight, has_bias: bool, rms: bool, features: int,
                    grid: Grid):
    """(dx, dweight, dbias or None) of :func:`norm2d_forward`."""
    n = features
    g = grad.float() * weight.float()  # d loss / d xhat
    proj = grid.row.all_reduce((g * xhat).sum(-1, keepdim=True)) / n
    inner = g - xhat * proj
    if not rms:
        inner = inner - grid.row.all_reduce(g.sum(-1, keepdim=True)) / n
    grad_x = (inner * rstd).to(grad.dtype)
    grad_w = grid.col.all_reduce(_flat(grad.float() * xhat).sum(0)).to(weight.dtype)
    grad_b = bias2d_grad(grad, grid) if has_bias else None
    return grad_x, grad_w, grad_b


class Norm2DFn(torch.autograd.Function):
    """LayerNorm (``bias`` may be None) or RMSNorm (``rms=True``) over features split by column.

    Statistics are sums over the whole feature dim: local sums, then an all-reduce along the
    grid row. Computed in fp32 like the single-device norms.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, features: int, grid: Grid):
        y, xhat, rstd = norm2d_forward(x, weight, bias, eps, rms, features, grid)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.rms, ctx.features, ctx.grid, ctx.has_bias = rms, features, grid, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        grads = norm2d_backward(grad, xhat, rstd, weight, ctx.has_bias, ctx.rms, ctx.features,
                                ctx.grid)
        return (*grads, None, None, None, None)


# --------------------------------------------------------------------------- embedding
def embedding2d_forward(ids: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Lookup of ``ids`` (this rank's batch slice) in a (V, C) table cut into q x q blocks.

    Output block (i, j) = sum_k onehot(ids_i)[:, V_k] W_kj: step k broadcasts W_kj down
    column j and each rank picks the rows of its ids that fall in V_k.
    """
    rows = weight.shape[0]  # V/q
    out = None
    for k in range(grid.q):
        block = grid.col.broadcast(weight.contiguous() if grid.i == k
                                   else torch.empty_like(weight), src=k)  # W_kj
        local_ids = ids - k * rows
        outside = (local_ids < 0) | (local_ids >= rows)
        part = block[local_ids.masked_fill(outside, 0)].masked_fill(outside[..., None], 0.0)
        out = part if out is None else out + part  # (..., C/q)
    return out


def embedding2d_backward(grad: torch.Tensor, ids: torch.Tensor, shape, grid: Grid
                         ) -> torch.Tensor:
    """Weight-block gradient: the output gradient scattered into a (V/q, C/q) block per
    step, reduced down the column to (k, j)."""
    rows, cols = shape
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
    return grad_w


class Embedding2DFn(torch.autograd.Function):
    """Autograd function of :func:`embedding2d_forward` (see there for the algorithm)."""

    @staticmethod
    def forward(ctx, ids, weight, grid: Grid):
        ctx.save_for_backward(ids)
        ctx.grid, ctx.shape = grid, weight.shape
        return embedding2d_forward(ids, weight, grid)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, embedding2d_backward(grad, ids, ctx.shape, ctx.grid), None
