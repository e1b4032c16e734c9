"""One 16-bit copy of each tensor-parallel weight shard per step, not one per micro-batch.

Under autocast a matmul casts its fp32 operands to 16 bits and keeps the copy of the weight
for its backward. autocast caches the copy of a leaf tensor, so the micro-batches a stage
holds at once share one copy of each plain weight (``PipelineProgram.step_casts``). A tensor
parallel weight is a DTensor, and a stage reads its local shard through ``to_local()``,
which is not a leaf: without more, each micro-batch in flight (and each half of a
sub-pipelined one) would cast the shard again and keep its own copy.

Here a stage piece's graph is rewritten so that every read of a shard by an op autocast runs
in 16 bits (through layout-only views: ``view_as``, ``t``, slices, splits) reads
:func:`dtensor_local_cast` instead: within :func:`shared_shard_casts` (a training step in
which the stage's micro-batches share casts) it returns one copy of the shard, made on the
first read and kept until the step ends; elsewhere the plain shard, which autocast casts as
before. A sub-pipelined piece's forward shares one copy between its two halves in any case
(``subpipe_run.py``). Other reads (norm weights, embeddings, biases added outside a matmul)
keep reading the fp32 shard.

The results are bit-for-bit those of autocast's own casts: casting commutes with the views,
and every read is its own autograd node (:class:`_SharedCast`, over a copy made without
autograd), whose backward hands the fp32 shard its reader's gradient in fp32, as autocast's
cast of that read would: two readers' gradients meet in fp32, not in 16 bits, and each
micro-batch's backward accumulates into the parameter as before.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from tessera.parallel.pipeline.cost import op_name

# Ops autocast runs in 16 bits on CPU and CUDA, casting every floating argument
# (tests/parallel/pipeline/test_shard_casts.py checks each on CPU).
LOWER_PRECISION_OPS = frozenset({
    "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})

# Ops that only rearrange values: a cast before them equals a cast after them, and their
# backward moves the gradient without summing it (so not ``expand``, whose backward sums:
# in 16 bits after a shared cast, in fp32 after autocast's).
LAYOUT_OPS = frozenset({
    "view", "view_as", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "alias",
    "getitem",
})



def is_layout(node: fx.Node) -> bool:
    """Whether ``node`` only rearranges values (``view(dtype)`` reinterprets bits: not)."""
    return op_name(node) in LAYOUT_OPS and node.target is not torch.ops.aten.view.dtype


# The step's copies (parameter -> its 16-bit shard), or None outside a sharing step.
_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shard_casts",
                                                                   default=None)


def dtensor_local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter, differentiable (tensor parallel stages)."""
    return param.to_local() if isinstance(param, DTensor) else param


def dtensor_local_cast(param: torch.Tensor) -> torch.Tensor:
    """The shard as a 16-bit op under autocast reads it: the step's shared copy inside
    :func:`shared_shard_casts` with autograd on, else the fp32 shard (autocast casts it)."""
    shard = dtensor_local(param)
    casts = _CASTS.get()
    device = shard.device.type
    if (casts is None or not torch.is_grad_enabled() or shard.dtype != torch.float32
            or not torch.is_autocast_enabled(device)):
        return shard
    if param not in casts:
        casts[param] = shard.detach().to(torch.get_autocast_dtype(device))
    return _SharedCast.apply(shard, casts[param])


class _SharedCast(torch.autograd.Function):
    """``copy`` (the shard's 16-bit copy) as this read's value; the gradient goes to the
    fp32 shard as autocast's cast of the read would send it (cast to fp32, per read)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        return copy  # an alias of the copy: no new memory

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.float(), None


@contextlib.contextmanager
def shared_shard_casts():
    """Within it, :func:`dtensor_local_cast` makes each shard's 16-bit copy once and hands
    it to every later read; the copies are dropped when it exits. Nested in another, it
    shares the enclosing one's copies."""
    if _CASTS.get() is not None:
        yield
        return
    token = _CASTS.set({})
    try:
        yield
    finally:
        _CASTS.reset(token)


def read_casts_of_shards(graph: fx.Graph) -> int:
    """Point every 16-bit op's read of a ``dtensor_local`` shard (directly or through
    layout ops) at a twin chain of its own starting from :func:`dtensor_local_cast`; drop
    what is left unread. Returns how many reads were rewritten."""
    rewritten = 0
    for shard in [n for n in graph.nodes if n.target is dtensor_local]:
        views = _layout_closure(shard)
        members = set(views)
        for node in views:
            for user in list(node.users):
                if op_name(user) in LOWER_PRECISION_OPS:
                    # One chain per read: its gradient reaches the shard on its own, in fp32.
                    twin = _twin(graph, node, shard, members, {})
                    user.replace_input_with(node, twin)
                    rewritten += 1
        for node in reversed(views):
            if not node.users:
                graph.erase_node(node)
    return rewritten


def _layout_closure(shard: fx.Node) -> list[fx.Node]:
    """``shard`` and the layout ops reading it (transitively), in graph order."""
    found, stack = {shard}, [shard]
    while stack:
        for user in stack.pop().users:
            if user not in found and is_layout(user):
                found.add(user)
                stack.append(user)
    order = {node: i for i, node in enumerate(shard.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _twin(graph: fx.Graph, node: fx.Node, shard: fx.Node, views: set[fx.Node],
          twins: dict[fx.Node, fx.Node]) -> fx.Node:
    """``node``'s copy reading the cast shard instead of the fp32 one."""
    if node not in twins:
        if node is shard:
            with graph.inserting_after(node):
                twins[node] = graph.call_function(dtensor_local_cast, node.args, node.kwargs)
        else:
            args = {a: _twin(graph, a, shard, views, twins)
                    for a in node.all_input_nodes if a in views}
            with graph.inserting_after(node):
                twins[node] = graph.node_copy(node, lambda a: args.get(a, a))
            twins[node].meta.pop("val", None)  # the fp32 value's; this one is 16-bit
    return twins[node]
