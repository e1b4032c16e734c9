"""Megatron sequence parallelism (``tp_seq=on``) as ``torch.library`` custom ops.

The eager layers split the sequence with autograd Functions (``comm.GatherSeq``, ...), which
``torch.export`` would inline into their forwards, losing the backward collectives. Pipeline
stages are captured graphs, so there the same collectives are these ops, each an opaque node
with its backward registered (as ``ops.py`` does for Megatron's f and g). Activations are
(B, T/tp, C) between the blocks; ``group`` is the name ``ops.register_group`` gave the tp
group.

Column layers keep their block input's shard, not the gathered (B, T, C) input, and gather it
again in backward (:func:`tp_seq_linear`). The eager layers share that gather between a
block's column layers through a Python attribute on the gathered tensor, which a captured
graph cannot carry; here the ops name their block instead (``block``, baked into the graph
at capture): the first column layer of a block to run backward gathers, the others of the
same block reuse it while the shard is the same tensor, and the block input's own backward
(:func:`tp_seq_gather`'s, which runs after all of them) drops it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tessera.parallel.tensor.comm import own_rows
from tessera.parallel.tensor.ops import group_named

# block -> (the shard's data pointer, its version, its dtype, the gathered input (B, T, C))
_REGATHERED: dict[str, tuple[int, int, torch.dtype, torch.Tensor]] = {}


def _gathered_shape(x: torch.Tensor, group: str) -> list[int]:
    return [x.shape[0], x.shape[1] * group_named(group).size, *x.shape[2:]]


def _own_rows_shape(x: torch.Tensor, group: str) -> list[int]:
    size = group_named(group).size
    return [x.shape[0], x.shape[1] // size, *x.shape[2:]]


def _rows(x: torch.Tensor, group: str) -> torch.Tensor:
    return own_rows(x, group_named(group))


def _gather(x: torch.Tensor, group: str) -> torch.Tensor:
    return group_named(group).all_gather(x.contiguous(), dim=1)


def _reduce_scatter(x: torch.Tensor, group: str) -> torch.Tensor:
    return group_named(group).reduce_scatter(x.contiguous(), dim=1)


def _remember(ctx, inputs, output):
    ctx.group = inputs[1]


# ------------------------------------------------------- a block input: gathered from shards
@torch.library.custom_op("tessera::tp_seq_gather", mutates_args=())
def tp_seq_gather(x: torch.Tensor, group: str, block: str) -> torch.Tensor:
    """(B, T/tp, C) -> (B, T, C) all-gathered; backward reduce-scatters the gradient. A block
    input (``block`` names it, "" for none) also ends the sharing of its columns' re-gather."""
    _REGATHERED.pop(block, None)  # a new micro-batch, or a recomputation, of this block
    return _gather(x, group)


@tp_seq_gather.register_fake
def _(x, group, block):
    return x.new_empty(_gathered_shape(x, group))


def _gather_setup(ctx, inputs, output):
    ctx.group, ctx.block = inputs[1], inputs[2]


def _gather_backward(ctx, grad):
    _REGATHERED.pop(ctx.block, None)  # every column layer of the block has run backward
    return _reduce_scatter(grad, ctx.group), None, None


tp_seq_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


def _sequence_op(name: str, forward, backward, shape, doc: str):
    """A custom op ``(x, group) -> forward(x, group)`` whose fake has ``shape(x, group)`` and
    whose backward is ``backward(grad, group)``."""
    def op(x: torch.Tensor, group: str) -> torch.Tensor:
        return forward(x, group)

    op.__doc__ = doc
    op = torch.library.custom_op(f"tessera::{name}", mutates_args=())(op)
    op.register_fake(lambda x, group: x.new_empty(shape(x, group)))
    op.register_autograd(lambda ctx, grad: (backward(grad, ctx.group), None),
                         setup_context=_remember)
    return op


# The end of a row layer (and of the vocabulary-parallel embedding): reduce-scattered output
tp_seq_reduce_scatter = _sequence_op(
    "tp_seq_reduce_scatter", _reduce_scatter, _gather, _own_rows_shape,
    """(B, T, C) partial sums -> this rank's (B, T/tp, C) of their sum; backward all-gathers
    the gradient (a row layer's output, the vocabulary-parallel embedding's).""")

# A Hugging Face model's first and last decoder layer
tp_seq_scatter = _sequence_op(
    "tp_seq_scatter", _rows, _gather, _own_rows_shape,
    """(B, T, C), equal on every rank -> this rank's (B, T/tp, C); backward all-gathers the
    gradient (each rank's chunk carries its own rows of it).""")

tp_seq_gather_whole = _sequence_op(
    "tp_seq_gather_whole", _gather, _rows, _gathered_shape,
    """(B, T/tp, C) -> (B, T, C) for work every rank then repeats whole (a Hugging Face
    model's final norm and head); the gradient arrives whole and equal on every rank, so the
    backward keeps this rank's rows (no sum).""")


# ------------------------------------------------- a column layer that keeps the input shard
@torch.library.custom_op("tessera::tp_seq_linear", mutates_args=())
def tp_seq_linear(full: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], group: str, block: str) -> torch.Tensor:
    """``F.linear(full, weight, bias)`` (B, T, O/tp) that keeps ``shard`` (this rank's
    (B, T/tp, C) of ``full``) for backward instead of ``full``, and gathers it again there.
    Under autocast the product runs in autocast's dtype (autocast reaches inside the op)."""
    return F.linear(full, weight, bias)


@tp_seq_linear.register_fake
def _(full, shard, weight, bias, group, block):
    # Autocast reads as off inside a fake: a fake run under autocast converts the output
    # itself (pipeline/kept.py, ops2d.AUTOCAST_OUTPUT)
    return full.new_empty([*full.shape[:-1], weight.shape[0]])


def _linear_setup(ctx, inputs, output):
    full, shard, weight, bias, ctx.group, ctx.block = inputs
    ctx.save_for_backward(shard, weight)
    ctx.dtype = output.dtype  # the product's: autocast's when it is on
    ctx.full_dtype, ctx.bias_dtype = full.dtype, None if bias is None else bias.dtype


def _linear_backward(ctx, grad):
    shard, weight = ctx.saved_tensors
    needs_full, needs_w, needs_b = (ctx.needs_input_grad[i] for i in (0, 2, 3))
    grad = grad.to(ctx.dtype)
    flat = grad.reshape(-1, grad.shape[-1])  # (N, O/tp)
    grad_full = grad_w = grad_b = None
    if needs_full:  # this rank's part of the sum over output features
        grad_full = (grad @ weight.to(ctx.dtype)).to(ctx.full_dtype)
    if needs_w:  # the only use of the gathered input (the same answer on every rank)
        # Shared by the block's columns only while the block input's backward is to come
        # and drop it: with an input that needs no gradient, that backward never runs.
        block = ctx.block if needs_full else ""
        full = _regathered(shard, ctx.dtype, ctx.group, block)  # (B, T, C)
        grad_w = (flat.t() @ full.reshape(-1, full.shape[-1])).to(weight.dtype)  # (O/tp, C)
    if needs_b and ctx.bias_dtype is not None:
        grad_b = flat.sum(0).to(ctx.bias_dtype)
    return grad_full, None, grad_w, grad_b, None, None


def _regathered(shard: torch.Tensor, dtype: torch.dtype, group: str, block: str
                ) -> torch.Tensor:
    """The gathered input, in ``dtype``, from this rank's ``shard``: gathered once per block
    backward, a later column layer of the same ``block`` ("" for none) reusing it while
    ``shard`` is the same tensor (same storage and version)."""
    key = (shard.data_ptr(), shard._version, dtype)
    held = _REGATHERED.get(block) if block else None
    if held is not None and held[:3] == key:
        return held[3]
    full = _gather(shard.to(dtype), group)
    if block:
        _REGATHERED[block] = (*key, full)
    return full


tp_seq_linear.register_autograd(_linear_backward, setup_context=_linear_setup)

TP_SEQ_LINEAR = torch.ops.tessera.tp_seq_linear.default


# ------------------------------------------------------------------- the partitioner's price
SEQ_COLLECTIVES = frozenset({"tp_seq_gather", "tp_seq_reduce_scatter", "tp_seq_scatter",
                             "tp_seq_gather_whole"})
SEQ_LINEAR_NAME = "tp_seq_linear"  # the op name of TP_SEQ_LINEAR in a graph node


def seq_collective(target) -> str | None:
    """The name of the sequence collective a graph node's ``target`` is (one of
    :data:`SEQ_COLLECTIVES`; exported graphs hold the overload, fx the packet), else None."""
    for name in SEQ_COLLECTIVES:
        packet = getattr(torch.ops.tessera, name)
        if target is packet or target is packet.default:
            return name
    return None


def forget_regather(block: str) -> None:
    """End the sharing of ``block``'s re-gather (what :func:`tp_seq_gather` does forward and
    backward), for a caller that runs its collective itself (pipeline/subpipe_run.py)."""
    _REGATHERED.pop(block, None)


def seq_comm_bytes(op: str, node) -> tuple[float, float]:
    """(forward, backward) bytes an exported graph node of these ops moves: an all-gather or
    a reduce-scatter moves about the whole (B, T, C) tensor through each rank (a ring's
    (tp-1)/tp of it), half of an all-reduce's traffic. ``op`` is the node's op name."""
    def whole(value) -> float:
        val = value.meta.get("val") if hasattr(value, "meta") else None
        return float(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0.0

    gathered = whole(node)  # tp_seq_gather(_whole)'s output
    partial = whole(node.args[0])  # a reduce-scatter's input; a scatter's whole input
    if op == "tp_seq_gather":
        return gathered, gathered  # backward: the gradient reduce-scattered
    if op == "tp_seq_gather_whole":
        return gathered, 0.0  # backward keeps the rank's rows
    if op == "tp_seq_reduce_scatter":
        return partial, partial  # backward: the gradient all-gathered
    if op == "tp_seq_scatter":
        return 0.0, partial
    if op == SEQ_LINEAR_NAME:  # backward gathers the kept shard again, once per block
        block = node.args[5]
        readers = sum(1 for user in node.args[1].users if _is_seq_linear(user, block))
        return 0.0, whole(node.args[0]) / (max(readers, 1) if block else 1)
    raise ValueError(f"{op} is not one of Megatron sequence parallelism's ops")


def _is_seq_linear(node, block: str) -> bool:
    """Whether ``node`` is a ``tp_seq_linear`` of ``block`` (sharing its re-gather; one
    shard may feed two blocks, as Cohere's norm feeds its attention and its MLP)."""
    return (SEQ_LINEAR_NAME in str(getattr(node, "target", ""))
            and len(node.args) > 5 and node.args[5] == block)
