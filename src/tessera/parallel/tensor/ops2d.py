"""The 2D (SUMMA) layers as ``torch.library`` custom ops: 2D tensor parallelism that survives
export, so pipeline stages can be cut from a 2D-sharded model.

``torch.export`` inlines ``torch.autograd.Function``s into their forwards and runs them on fake
tensors, so the layers of ``layers2d.py`` can be neither captured (their broadcasts would run on
fake tensors) nor, if they could, differentiated (their backward SUMMA products would be lost).
Each layer is one custom op here: a single opaque graph node whose fake implementation gives
the output shape, and whose registered autograd formula runs the layer's backward when a
pipeline stage's backward reaches it. Forward and backward are the very functions the eager
autograd functions call (``layers2d.py``), so both paths compute the same blocks.

Why whole layers and not the row / column broadcasts one by one: SUMMA interleaves q
broadcasts with q partial products and reductions; as separate ops each would be a graph node
with a backward of its own, and autograd would keep every borrowed block for the backward,
which is the memory SUMMA exists to avoid (one borrowed block at a time).

The grid cannot be an op argument (ops take tensors, numbers and strings), so the ops take the
name it was registered under here (like the 1D ops of ``ops.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tessera.parallel.tensor.comm import Grid
from tessera.parallel.tensor.ops_seq import TP_SEQ_LINEAR
from tessera.parallel.tensor.layers2d import (add_bias2d, autocast_operands, bias2d_grad,
                                              embedding2d_backward, embedding2d_forward,
                                              linear2d_backward, linear2d_forward,
                                              norm2d_backward, norm2d_forward, saved_input)

_GRIDS: dict[str, Grid] = {}


def register_grid(grid: Grid) -> str:
    """Make ``grid`` reachable from the ops; returns the name to pass them."""
    name = f"grid:{grid.flat.group.group_name}"
    _GRIDS[name] = grid
    return name


def grid_of(name: str) -> Grid:
    """The grid registered under ``name`` on this rank."""
    if name not in _GRIDS:
        raise RuntimeError(f"2D tensor-parallel grid {name!r} was not registered on this rank "
                           "(tessera.parallel.tensor.ops2d.register_grid)")
    return _GRIDS[name]


# ------------------------------------------------------------------------------ linear
@torch.library.custom_op("tessera::summa_linear", mutates_args=())
def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: str, conv1d: bool
                 ) -> torch.Tensor:
    """Block (i, j) of X W^T (nn.Linear, weight (O/q, C/q)) or X W (Conv1D, (C/q, O/q)).

    Under autocast the products run in autocast's dtype, forward and backward (the backward
    runs outside autocast: it reads the dtype from the input it kept).
    """
    return linear2d_forward(*autocast_operands(x, weight), grid_of(grid), conv1d)


@summa_linear.register_fake
def _(x, weight, grid, conv1d):
    out = weight.shape[1] if conv1d else weight.shape[0]
    return x.new_empty(*x.shape[:-1], out)  # (B/q, T, O/q)


def _linear_setup(ctx, inputs, output):
    x, weight, ctx.grid, ctx.conv1d = inputs
    # The same as the eager Linear2DFn keeps: the input as the product read it (a second
    # cast here under autocast, as an op's setup sees only its inputs and output; autocast
    # is on here, unlike inside the fake) and the weight block itself.
    ctx.save_for_backward(saved_input(x, weight), weight)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = linear2d_backward(grad, x, weight, grid_of(ctx.grid), ctx.conv1d)
    return grad_x, grad_w, None, None


summa_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


# -------------------------------------------------------------------------------- bias
@torch.library.custom_op("tessera::summa_add_bias", mutates_args=())
def summa_add_bias(x: torch.Tensor, bias: torch.Tensor, grid: str) -> torch.Tensor:
    """x + b in ``x``'s dtype (layers2d.add_bias2d), b this grid column's feature slice; its
    gradient sums the grid column."""
    return add_bias2d(x, bias)


@summa_add_bias.register_fake
def _(x, bias, grid):
    return torch.empty_like(x)


def _bias_setup(ctx, inputs, output):
    ctx.grid = inputs[2]


def _bias_backward(ctx, grad):
    return grad, bias2d_grad(grad, grid_of(ctx.grid)), None


summa_add_bias.register_autograd(_bias_backward, setup_context=_bias_setup)


# -------------------------------------------------------------------------------- norm
@torch.library.custom_op("tessera::summa_norm", mutates_args=())
def summa_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               rms: bool, features: int, grid: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm over features split by grid column: (y, xhat, rstd).

    ``xhat`` (fp32, like x) and ``rstd`` (B/q, T, 1) are what the backward needs; returning
    them keeps the backward free of the forward's statistics all-reduces (an op's autograd
    formula sees only its inputs and outputs). Nothing downstream reads them.
    """
    return norm2d_forward(x, weight, bias, eps, rms, features, grid_of(grid))


@summa_norm.register_fake
def _(x, weight, bias, eps, rms, features, grid):
    stats = x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
    dtype = torch.promote_types(x.dtype, weight.dtype)  # as norm2d_forward's y
    if bias is not None:
        dtype = torch.promote_types(dtype, bias.dtype)
    return torch.empty_like(x, dtype=dtype), torch.empty_like(x, dtype=torch.float32), stats


def _norm_setup(ctx, inputs, output):
    _, weight, bias, _, ctx.rms, ctx.features, ctx.grid = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(output[1], output[2], weight)


def _norm_backward(ctx, grad, _grad_xhat, _grad_rstd):  # by-products: nothing reads them
    xhat, rstd, weight = ctx.saved_tensors
    grads = norm2d_backward(grad, xhat, rstd, weight, ctx.has_bias, ctx.rms, ctx.features,
                            grid_of(ctx.grid))
    return (*grads, None, None, None, None)


summa_norm.register_autograd(_norm_backward, setup_context=_norm_setup)


# --------------------------------------------------------------------------- embedding
@torch.library.custom_op("tessera::summa_embedding", mutates_args=())
def summa_embedding(ids: torch.Tensor, weight: torch.Tensor, grid: str) -> torch.Tensor:
    """Lookup of this grid row's ``ids`` (B/q, T) in the (V/q, C/q) blocks: (B/q, T, C/q)."""
    return embedding2d_forward(ids, weight, grid_of(grid))


@summa_embedding.register_fake
def _(ids, weight, grid):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _embedding_setup(ctx, inputs, output):
    ids, weight, ctx.grid = inputs
    ctx.shape = tuple(weight.shape)
    ctx.save_for_backward(ids)


def _embedding_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return None, embedding2d_backward(grad, ids, ctx.shape, grid_of(ctx.grid)), None


summa_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)

SUMMA_LINEAR = torch.ops.tessera.summa_linear.default
# Ops whose output takes autocast's dtype when autocast is on (also Megatron sequence
# parallelism's column layer). Their fakes cannot say so: autocast reads as off inside a fake
# implementation, so a fake run under autocast (the pipeline's activation estimate,
# pipeline/kept.py) converts their outputs itself.
AUTOCAST_OUTPUT = (SUMMA_LINEAR, TP_SEQ_LINEAR)


def summa_linear_flops(node) -> float:
    """Forward FLOPs of one rank's ``summa_linear`` node (pipeline cost model).

    Per step a rank multiplies its (m, C/q) block by a (C/q, O/q) block; q steps give
    2 m C O / q = 2 * numel(out) * C/q * q (``x.shape[-1]`` is C/q).
    """
    x, weight, grid = node.args[0].meta["val"], node.args[1].meta["val"], node.args[2]
    out = weight.shape[1] if node.args[3] else weight.shape[0]
    rows = x.numel() // x.shape[-1]
    return 2.0 * rows * out * x.shape[-1] * grid_of(grid).q


def summa_linear_comm_bytes(node) -> float:
    """Bytes one rank's ``summa_linear`` node sends or receives in forward (pipeline cost
    model); the backward's two products move twice as much.

    nn.Linear runs A B^T (summa.summa_abt): q steps each broadcast a weight block along the
    column and reduce an output-sized partial along the row. Conv1D runs A B (summa_ab): q
    steps each broadcast an input block and a weight block. A broadcast or reduce tree moves
    about its payload per rank (an all-reduce twice that).
    """
    x, weight, grid = node.args[0].meta["val"], node.args[1].meta["val"], node.args[2]
    blocks = x if node.args[3] else node.meta["val"]  # Conv1D: X's block; else Y's partial
    size = weight.element_size()
    return float(grid_of(grid).q * (weight.numel() + blocks.numel()) * size)
