"""Megatron's f / g as ``torch.library`` custom ops: tensor parallelism that survives export.

``torch.export`` inlines ``torch.autograd.Function``s into their forwards, so a captured
graph of the layers in ``layers1d.py`` would keep their forward collectives and lose the
backward ones. Custom ops with a registered autograd formula stay single, opaque nodes in the
exported graph, and running the graph eagerly (a pipeline stage) calls that formula. The 1D
layers are built from them when the model is to be captured (``exportable=True`` on the
modules): ``F.linear(tp_copy(x))`` is a column layer, ``tp_reduce(F.linear(x))`` a row layer.

The process group cannot be an op argument (ops take tensors, numbers and strings), so the
ops take the name a :class:`TPGroup` was registered under here, the way torch's functional
collectives take a group name.

Sub-pipelined tensor parallelism (``pipeline/subpipe.py``) finds these nodes in a stage's
graph and runs their all-reduces itself, asynchronously, from the group :func:`group_named`
returns.
"""

from __future__ import annotations

import torch

from tessera.parallel.tensor.comm import TPGroup

_GROUPS: dict[str, TPGroup] = {}


def register_group(group: TPGroup) -> str:
    """Make ``group`` reachable from the ops; returns the name to pass them."""
    name = f"tp:{group.group.group_name}"
    _GROUPS[name] = group
    return name


def group_named(name: str) -> TPGroup:
    """The group :func:`register_group` filed under ``name``."""
    if name not in _GROUPS:
        raise RuntimeError(f"tensor-parallel group {name!r} was not registered on this rank "
                           "(tessera.parallel.tensor.ops.register_group)")
    return _GROUPS[name]


# ---------------------------------------------------------------------------- f: tp_copy
@torch.library.custom_op("tessera::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; the backward all-reduces the gradient over ``group`` (Megatron f)."""
    return x.clone()  # a custom op may not return its input


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_backward(ctx, grad):
    return group_named(ctx.group).all_reduce(grad.contiguous().clone()), None


def _remember_group(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(_copy_backward, setup_context=_remember_group)


# -------------------------------------------------------------------------- g: tp_reduce
@torch.library.custom_op("tessera::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of ``x`` over ``group`` forward; identity backward (Megatron g)."""
    return group_named(group).all_reduce(x.contiguous().clone())


@tp_reduce.register_fake
def _(x, group):
    return x.new_empty(x.shape)  # contiguous, as the real op's clone


def _identity_backward(ctx, grad):
    return grad, None


tp_reduce.register_autograd(_identity_backward)


# ------------------------------------------------------------- a row layer's bias: tp_add_bias
@torch.library.custom_op("tessera::tp_add_bias", mutates_args=())
def tp_add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` in ``x``'s dtype, decided when the op runs: a row layer's bias after g.

    nn.Linear adds its bias inside its product, so under autocast a 16-bit product stays
    16-bit (as the eager ``RowLinearFn`` adds it). A plain ``+`` in a captured graph promoted a
    bf16 product plus an fp32 bias to fp32, and a cast written into the graph would keep the
    capture's dtype (fp32) where chunk memory later runs 16-bit parameters.
    """
    return x + bias.to(x.dtype)


@tp_add_bias.register_fake
def _(x, bias):
    return torch.empty_like(x)


def _bias_setup(ctx, inputs, output):
    ctx.bias_dtype = inputs[1].dtype


def _bias_backward(ctx, grad):
    # (N, O) summed over tokens in the gradient's dtype, as RowLinearFn sums it
    return grad, grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)


tp_add_bias.register_autograd(_bias_backward, setup_context=_bias_setup)


TP_REDUCE = torch.ops.tessera.tp_reduce.default
TP_COPY = torch.ops.tessera.tp_copy.default


def is_tp_reduce(target) -> bool:
    """Whether a graph node's target is g (exported graphs hold the overload, fx the packet)."""
    return target is TP_REDUCE or target is torch.ops.tessera.tp_reduce


def is_tp_copy(target) -> bool:
    """Whether a graph node's target is f (as :func:`is_tp_reduce`)."""
    return target is TP_COPY or target is torch.ops.tessera.tp_copy
