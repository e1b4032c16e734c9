"""Sub-pipelined tensor parallelism (Merak, section 4.3): one half's all-reduce under the other
half's compute.

A stage piece captured at half the micro-batch (B/2, T) is run twice in one fx graph, on the
two halves of the micro-batch, interleaved: every forward all-reduce of tensor parallelism
(``tp_reduce``, Megatron's g) is split into ``tp_reduce_start`` (asynchronous; gloo and NCCL
run it on their own thread / stream) and ``tp_wait``, and the two halves take turns between
them, half 1 one segment behind half 0::

    S0(h0) start0(h0) | S0(h1) start0(h1) | wait0(h0) S1(h0) start1(h0) | wait0(h1) S1(h1) ...

so the all-reduce of one half runs while the other half computes the segment ``S`` between
two all-reduces. Parameters are shared; the halves' outputs are concatenated, so neighbours
send and receive whole micro-batches as before. The backward all-reduces (of ``tp_copy``, f)
stay synchronous: autograd orders the two halves' backward nodes itself.
"""

from __future__ import annotations

import torch
from torch import fx

from tessera.parallel.pipeline.split import Piece
from tessera.parallel.tensor.ops import TP_REDUCE_START, TP_WAIT, is_tp_reduce

HALVES = 2


def subpipeline(piece: Piece) -> Piece:
    """The same piece taking whole micro-batches, run as two interleaved halves.

    ``piece`` must have been built from a graph captured at half the micro-batch; every
    input and output has the batch as its first dimension.
    """
    old = piece.module.graph
    new = fx.Graph()
    envs: list[dict[str, fx.Node]] = [{} for _ in range(HALVES)]
    for node in old.nodes:
        if node.op == "placeholder":  # (B, ...) -> HALVES x (B/2, ...)
            halves = new.call_function(torch.chunk, (new.placeholder(node.name), HALVES, 0))
            for h, env in enumerate(envs):
                env[node.name] = new.call_function(_item, (halves, h))
    body = [n for n in old.nodes if n.op not in ("placeholder", "output")]
    _interleave(new, body, envs)
    (result,) = [n for n in old.nodes if n.op == "output"]
    outputs = []
    for out in result.args[0]:
        outputs.append(new.call_function(torch.cat, ([env[out.name] for env in envs], 0)))
    new.output(tuple(outputs))
    module = fx.GraphModule(piece.module, new)
    return Piece(module, piece.inputs, piece.batch, piece.outputs, piece.params)


def _item(values, index: int):
    return values[index]


def _interleave(new: fx.Graph, body: list[fx.Node], envs: list[dict[str, fx.Node]]) -> None:
    """Copy ``body`` once per half, switching halves after each started all-reduce."""
    position = [0] * HALVES
    started: list[tuple[str, fx.Node] | None] = [None] * HALVES
    while any(p < len(body) for p in position) or any(started):
        for h, env in enumerate(envs):
            if started[h] is not None:  # resume: the all-reduce's result is needed from here
                name, start = started[h]
                env[name] = new.call_function(TP_WAIT, (start,))
                started[h] = None
            while position[h] < len(body):
                node = body[position[h]]
                position[h] += 1
                if is_tp_reduce(node.target):
                    x, group = node.args
                    start = new.call_function(TP_REDUCE_START, (env[x.name], group))
                    started[h] = (node.name, start)
                    break  # the other half computes while this all-reduce runs
                env[node.name] = new.node_copy(node, lambda n, env=env: env[n.name])
