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

``tp_reduce_start`` / ``tp_wait`` split ``tp_reduce`` in two for sub-pipelined tensor
parallelism: the all-reduce runs asynchronously (gloo runs it on its own thread) between them,
while the other half of the micro-batch computes (``pipeline/subpipe.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.parallel.tensor.comm import TPGroup

_GROUPS: dict[str, TPGroup] = {}
_PENDING: dict[int, dist.Work] = {}  # data_ptr of a tp_reduce_start output -> its all-reduce


def register_group(group: TPGroup) -> str:
    """Make ``group`` reachable from the ops; returns the name to pass them."""
    name = f"tp:{group.group.group_name}"
    _GROUPS[name] = group
    return name


def _group(name: str) -> TPGroup:
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
    return _group(ctx.group).all_reduce(grad.contiguous().clone()), None


def _remember_group(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(_copy_backward, setup_context=_remember_group)


# -------------------------------------------------------------------------- g: tp_reduce
@torch.library.custom_op("tessera::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of ``x`` over ``group`` forward; identity backward (Megatron g)."""
    return _group(group).all_reduce(x.contiguous().clone())


@tp_reduce.register_fake
def _(x, group):
    return x.new_empty(x.shape)  # contiguous, as the real op's clone


def _identity_backward(ctx, grad):
    return grad, None


tp_reduce.register_autograd(_identity_backward)


# ------------------------------------------------------- g split in two: start, then wait
@torch.library.custom_op("tessera::tp_reduce_start", mutates_args=())
def tp_reduce_start(x: torch.Tensor, group: str) -> torch.Tensor:
    """Start the sum of ``x`` over ``group``; the result is valid after :func:`tp_wait`."""
    tp = _group(group)
    out = x.contiguous().clone()
    if tp.size > 1:
        tp._count("all_reduce", out)
        _PENDING[out.data_ptr()] = dist.all_reduce(out, group=tp.group, async_op=True)
    return out


@tp_reduce_start.register_fake
def _(x, group):
    return x.new_empty(x.shape)  # contiguous, as the real op's clone


tp_reduce_start.register_autograd(_identity_backward)


@torch.library.custom_op("tessera::tp_wait", mutates_args=())
def tp_wait(x: torch.Tensor) -> torch.Tensor:
    """Wait for the all-reduce :func:`tp_reduce_start` began on ``x``; returns the sum."""
    work = _PENDING.pop(x.data_ptr(), None)
    if work is not None:
        work.wait()
    return x.clone()


@tp_wait.register_fake
def _(x):
    return torch.empty_like(x)


def _wait_backward(ctx, grad):
    return grad


tp_wait.register_autograd(_wait_backward)

TP_REDUCE = torch.ops.tessera.tp_reduce.default
TP_COPY = torch.ops.tessera.tp_copy.default
TP_REDUCE_START = torch.ops.tessera.tp_reduce_start.default
TP_WAIT = torch.ops.tessera.tp_wait.default


def is_tp_reduce(target) -> bool:
    """Whether a graph node's target is g (exported graphs hold the overload, fx the packet)."""
    return target is TP_REDUCE or target is torch.ops.tessera.tp_reduce
