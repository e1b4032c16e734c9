"""Running a sub-pipelined piece (``subpipe.py``): two halves of a micro-batch taking turns
at every tensor-parallel all-reduce, in the forward and in a hand-scheduled backward.

Forward: a half runs its segments up to the next g (``tp_reduce``), starts that all-reduce
and hands over to the other half; on its next turn it waits for the sum and goes on.
Backward: the mirror image, handing over at every f (``tp_copy``), whose gradient
all-reduce then runs under the other half's segment backward.

How the backward is wired, with autograd on: each compute segment reads its inputs through
an *inlet* and hands its outputs to an *outlet*, two small autograd Functions:

- an inlet passes a value through; its backward adds the segment's gradient of that value
  to the half's gradient table, instead of going on into the graph that produced it;
- an outlet turns the segment's outputs into one empty tensor; its backward takes their
  gradients from the table.

So every segment's graph stands alone, a backward from its outlet runs exactly that
segment, and the driver chooses the order and runs the collectives in between. Neither
Function keeps a tensor: a segment keeps for its backward what autograd keeps without them.

A segment's backward returns its weights' gradients instead of accumulating them; a weight's
halves (and segments, if several read it) are summed and accumulated once per micro-batch,
after its last reader's backward, as in a plain stage's backward. Hooks on accumulation
(chunk memory's state machine, the dp average's counts) see what they see there.

The whole piece is one node (``_Interleaved``) of the caller's graph, whose backward runs
the schedule. That backward runs once: ``retain_graph`` and double backward are not
supported, and it always accumulates the weights' gradients (``torch.autograd.grad`` with
``inputs`` would too), as the pipeline's stage backward expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.parallel.pipeline.shard_casts import shared_shard_casts
from tessera.parallel.tensor.comm import Started, own_rows
from tessera.parallel.tensor.ops import group_named
from tessera.parallel.tensor.ops_seq import forget_regather

HALVES = 2
Grads = dict[str, torch.Tensor]  # one half's gradients by value name, summed over readers


def run_interleaved(cut, args: tuple) -> tuple:
    """The results of a cut piece (``subpipe.Cut``) on whole micro-batches ``args``;
    differentiable when autograd is on."""
    if not torch.is_grad_enabled():
        return _Run(cut, args, grad=False).forward()
    # Weights need gradients even when no argument does (the first stage reads token ids):
    # an argument that requires one keeps this node in the caller's graph.
    anchor = torch.empty(0, requires_grad=True)
    return _Interleaved.apply(cut, anchor, *args)


def halves(value):
    """``value`` split into the halves' parts along the batch (non-tensors: itself twice)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % HALVES:
            raise RuntimeError(f"sub-pipelined stages (tp_overlap=subpipe) split every input "
                               f"along its first dimension into {HALVES}; got shape "
                               f"{tuple(value.shape)}")
        return value.chunk(HALVES)
    return (value,) * HALVES


class _Interleaved(torch.autograd.Function):
    """The piece as one node: forward runs both halves, backward the interleaved schedule."""

    @staticmethod
    def forward(ctx, cut, anchor, *args):
        ctx.set_materialize_grads(False)
        run = _Run(cut, args, grad=True, anchor=anchor)
        # Both halves read one 16-bit copy of each tp shard under autocast, not one each.
        with torch.enable_grad(), shared_shard_casts():
            results = run.forward()
        ctx.run = run
        ctx.mark_non_differentiable(*[r for r in results if not _differentiable(r)])
        return results

    @staticmethod
    def backward(ctx, *grads):
        run, ctx.run = ctx.run, None  # the segments' graphs go as their backwards run
        if run is None:
            raise RuntimeError("a sub-pipelined stage piece (tp_overlap=subpipe) runs its "
                               "backward once: retain_graph and double backward are not "
                               "supported")
        return (None, None, *run.backward(grads))


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _refuse_tensor_hooks(weights: list[torch.Tensor]) -> None:
    """A weight's gradient is taken per half and accumulated as their sum: a tensor hook
    (``register_hook``) would run on each half and again on the sum."""
    for w in weights:
        if w._backward_hooks:
            raise RuntimeError(f"tp_overlap=subpipe: a weight of shape {tuple(w.shape)} has a "
                               "tensor hook (register_hook), which sub-pipelining would run "
                               "three times per micro-batch; use "
                               "register_post_accumulate_grad_hook, or tp_overlap=none")


# What each collective segment does (forward, backward): "identity", "rows" (this rank's
# sequence chunk, dim 1, no communication), or a collective started asynchronously
# ("all_reduce"; "all_gather" and "reduce_scatter" along the sequence, dim 1).
COLLECTIVES = {
    "reduce": ("all_reduce", "identity"),  # Megatron's g
    "copy": ("identity", "all_reduce"),  # Megatron's f
    # Megatron sequence parallelism (tensor/ops_seq.py)
    "tp_seq_gather": ("all_gather", "reduce_scatter"),
    "tp_seq_reduce_scatter": ("reduce_scatter", "all_gather"),
    "tp_seq_scatter": ("rows", "all_gather"),
    "tp_seq_gather_whole": ("all_gather", "rows"),
}


@dataclass
class _Pending:
    """A collective under way: its result lands as value (or gradient) ``name``."""

    name: str
    started: Started

    def finish(self) -> torch.Tensor:
        return self.started.wait()


def _apply(action: str, value: torch.Tensor, segment, name: str
           ) -> tuple[torch.Tensor | None, _Pending | None]:
    """``action`` (a :data:`COLLECTIVES` entry) on ``value`` for ``segment``: (the result now,
    or the collective started, landing as ``name``)."""
    if action == "identity":
        return value, None
    group = group_named(segment.group)
    if action == "rows":
        return own_rows(value.detach(), group), None
    if segment.block:  # a block input's gather: its column layers' re-gather is over
        forget_regather(segment.block)
    value = value.detach()
    if action == "all_reduce":  # in place, so on a copy
        started = group.all_reduce_start(value.clone(memory_format=torch.contiguous_format))
    elif action == "all_gather":
        started = group.all_gather_start(value, dim=1)
    else:
        started = group.reduce_scatter_start(value, dim=1)
    return None, _Pending(name, started)


class _Run:
    """One micro-batch through a cut piece as two halves. With ``grad``, each compute
    segment's outlet is kept for the backward."""

    def __init__(self, cut, args: tuple, grad: bool, anchor: torch.Tensor | None = None
                 ) -> None:
        self.cut, self.grad, self.anchor = cut, grad, anchor
        parts = [halves(a) for a in args]
        self.values: list[dict] = [{n: p[h] for n, p in zip(cut.arguments, parts)}
                                   for h in range(HALVES)]
        needs = {n: isinstance(a, torch.Tensor) and a.requires_grad
                 for n, a in zip(cut.arguments, args)}
        self.needs = [dict(needs) for _ in range(HALVES)]  # value -> a gradient reaches it
        self.arg_needs = [needs[n] for n in cut.arguments]
        self.grads: list[Grads] = [{} for _ in range(HALVES)]
        self.outlets: list[dict[int, torch.Tensor]] = [{} for _ in range(HALVES)]
        # Each weight's segment backwards still to run (both halves), and its gradient
        # summed so far: accumulated when none is left.
        self.readers_left = cut.readers() if grad else {}
        if grad:
            for segment in cut.segments:
                _refuse_tensor_hooks(segment.weights)  # hooks may come after the cut
        self.weight_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------- forward
    def forward(self) -> tuple:
        _take_turns(range(len(self.cut.segments)), self._forward_step, self._land_value)
        with torch.no_grad():
            results = tuple(torch.cat([v[n] for v in self.values]) for n in self.cut.results)
        self.values = []  # the halves of the results: the caller holds them whole
        return results

    def _forward_step(self, h: int, index: int) -> _Pending | None:
        segment, values = self.cut.segments[index], self.values[h]
        started = None
        if segment.kind == "compute":
            self._compute(h, index, segment)
        else:
            (source,), (out,) = segment.inputs, segment.outputs
            self.needs[h][out] = self.needs[h][source]
            now, started = _apply(COLLECTIVES[segment.kind][0], values[source], segment, out)
            if now is not None:
                values[out] = now
        self._release(values, segment, index)
        return started

    def _land_value(self, h: int, pending: _Pending) -> None:
        self.values[h][pending.name] = pending.finish()

    def _compute(self, h: int, index: int, segment) -> None:
        values, needs = self.values[h], self.needs[h]
        inputs = []
        for name in segment.inputs:
            value = values[name]
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(f"sub-pipelined stages pass tensors between segments; "
                                   f"{name} is a {type(value).__name__}")
            if self.grad and needs[name]:  # requires_grad: a float or complex tensor
                value = _Inlet.apply(self.grads[h], name, self.anchor, value.detach())
            inputs.append(value)
        outputs = segment.module(*inputs)
        wanted = []
        for name, out in zip(segment.outputs, outputs):
            values[name] = out
            needs[name] = isinstance(out, torch.Tensor) and out.requires_grad
            if needs[name]:
                wanted.append((name, out))
        if self.grad and wanted:
            names, tensors = zip(*wanted)
            self.outlets[h][index] = _Outlet.apply(self.grads[h], names, *tensors)

    def _release(self, values: dict, segment, index: int) -> None:
        """Drop the values no later segment reads (the piece's results stay)."""
        for name in segment.inputs:
            if self.cut.last_use[name] == index:
                values.pop(name, None)

    # ------------------------------------------------------------------------ backward
    def backward(self, grads: tuple) -> list[torch.Tensor | None]:
        for name, grad in zip(self.cut.results, grads):
            if grad is not None:
                for table, part in zip(self.grads, halves(grad)):
                    _add(table, name, part)
        _take_turns(range(len(self.cut.segments) - 1, -1, -1), self._backward_step,
                    self._land_grad)
        self._accumulate(list(self.weight_grads))  # none left when every reader ran
        return [self._argument_grad(name) if needs else None
                for name, needs in zip(self.cut.arguments, self.arg_needs)]

    def _backward_step(self, h: int, index: int) -> _Pending | None:
        segment, table = self.cut.segments[index], self.grads[h]
        if segment.kind == "compute":
            self._segment_backward(h, index, segment)
            return None
        grad = table.pop(segment.outputs[0], None)
        if grad is None:
            return None
        now, started = _apply(COLLECTIVES[segment.kind][1], grad, segment, segment.inputs[0])
        if now is not None:
            _add(table, segment.inputs[0], now)
        return started

    def _land_grad(self, h: int, pending: _Pending) -> None:
        _add(self.grads[h], pending.name, pending.finish())

    def _segment_backward(self, h: int, index: int, segment) -> None:
        """Segment ``index``'s backward for half ``h``: its inputs' gradients into the table
        (through the inlets), its weights' summed here; weights whose last reader this was
        accumulate."""
        weights, outlet = segment.weights, self.outlets[h].pop(index, None)
        if outlet is not None and any(n in self.grads[h] for n in segment.outputs):
            # The anchor is every inlet's input: asking for its (empty) gradient runs them.
            grads = torch.autograd.grad(outlet, [self.anchor, *weights], outlet.new_empty(0),
                                        allow_unused=True)[1:]
            for w, g in zip(weights, grads):
                if g is not None:
                    summed = self.weight_grads.get(id(w))
                    self.weight_grads[id(w)] = (w, g if summed is None else summed[1] + g)
        done = []
        for w in weights:
            self.readers_left[id(w)] -= 1
            if self.readers_left[id(w)] == 0 and id(w) in self.weight_grads:
                done.append(id(w))
        self._accumulate(done)

    def _accumulate(self, keys: list[int]) -> None:
        """Accumulate the summed gradients of these weights, once each (autograd's
        accumulation: ``.grad`` and its hooks)."""
        pairs = [self.weight_grads.pop(k) for k in keys]
        if pairs:
            torch.autograd.backward([w for w, _ in pairs], [g for _, g in pairs])

    def _argument_grad(self, name: str) -> torch.Tensor | None:
        parts = [table.pop(name, None) for table in self.grads]
        if all(p is None for p in parts):
            return None
        like = next(p for p in parts if p is not None)
        return torch.cat([torch.zeros_like(like) if p is None else p for p in parts])


def _take_turns(order: range, step, land) -> None:
    """Each half runs ``step(h, index)`` over ``order`` until a step starts an all-reduce
    (returns a _Pending); then the other half runs while it does. On the half's next turn,
    ``land(h, pending)`` takes the result and the half goes on."""
    position, waiting = [0] * HALVES, [None] * HALVES
    while any(p < len(order) for p in position) or any(waiting):
        for h in range(HALVES):
            if waiting[h] is not None:
                land(h, waiting[h])
                waiting[h] = None
            while position[h] < len(order) and waiting[h] is None:
                waiting[h] = step(h, order[position[h]])
                position[h] += 1


def _add(table: Grads, name: str, grad: torch.Tensor) -> None:
    table[name] = grad if name not in table else table[name] + grad


class _Inlet(torch.autograd.Function):
    """A segment's input: passed through; its gradient goes to the half's table."""

    @staticmethod
    def forward(ctx, table: Grads, name: str, anchor, value):
        ctx.table, ctx.name = table, name
        return value.view_as(value)  # a non-leaf: autocast does not cache its casts

    @staticmethod
    def backward(ctx, grad):
        _add(ctx.table, ctx.name, grad)
        return None, None, None, None


class _Outlet(torch.autograd.Function):
    """A segment's outputs as one empty tensor, whose backward reads their gradients from
    the half's table: ``backward()`` on it runs the segment's backward."""

    @staticmethod
    def forward(ctx, table: Grads, names: tuple, *outputs):
        ctx.table, ctx.names = table, names
        return outputs[0].new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return (None, None, *[ctx.table.pop(n, None) for n in ctx.names])
