"""Sub-pipelined tensor parallelism (Merak, section 4.3): one half's all-reduces under the
other half's compute, in the forward and in the backward.

A stage piece captured at half the micro-batch (B/2, T) is cut at its tensor-parallel
collectives (:func:`cut_at_collectives`): Megatron's g (``tp_reduce``, an all-reduce in the
forward) and f (``tp_copy``, an all-reduce in the backward). :class:`SubPipelined` runs the
segments between them on the two halves of each micro-batch, the halves taking turns at
every all-reduce, which runs asynchronously (gloo on its own thread, NCCL on its own stream)
while the other half computes::

    forward   S0(h0) g0-start(h0) | S0(h1) g0-start(h1) | g0-wait(h0) S1(h0) ...
    backward  ... S2'(h0) f2-start(h0) | S2'(h1) f2-start(h1) | f2-wait(h0) S1'(h0) ...

Autograd cannot run a backward in that order: it orders the backward by the forward, where
half 0's later segment runs after half 1's earlier one, so the wait for half 0's gradient
all-reduce would come before half 1's segment. The backward is therefore scheduled by hand
(``subpipe_run.py``). The halves' outputs are concatenated, so neighbouring stages send and
receive whole micro-batches as before.

Under Megatron sequence parallelism (``tp_seq=on``) the pieces hold its all-gathers and
reduce-scatters (tensor/ops_seq.py) in place of g, and the cut and the turns are at those
(``subpipe_run.COLLECTIVES``).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from tessera.parallel.pipeline.split import Piece
from tessera.parallel.pipeline.subpipe_run import HALVES, run_interleaved
from tessera.parallel.tensor.ops import is_tp_copy, is_tp_reduce
from tessera.parallel.tensor.ops_seq import seq_collective


@dataclass
class Segment:
    """Part of a piece between two tensor-parallel collectives, or one collective.

    Attributes:
        kind: "compute", "reduce" (g: all-reduce forward, identity backward), "copy" (f:
            identity forward, all-reduce backward), or the name of one of Megatron sequence
            parallelism's ops (tensor/ops_seq.SEQ_COLLECTIVES; subpipe_run.COLLECTIVES says
            what each does forward and backward).
        inputs: names of the values it reads that other segments (or the piece's
            arguments) produce; a collective reads one.
        outputs: names of its values read by later segments or returned by the piece.
        module: for "compute", ``module(*inputs) -> tuple(outputs)``.
        group: for a collective, the name its tensor-parallel group is registered under.
        weights: for "compute", what ``module`` holds that takes gradients: its parameters,
            and any buffer that requires one.
    """

    kind: str
    inputs: list[str]
    outputs: list[str]
    module: fx.GraphModule | None = None
    group: str = ""
    weights: list[torch.Tensor] = field(default_factory=list)
    block: str = ""  # a tp_seq_gather's block, whose column layers share one re-gather


@dataclass
class Cut:
    """A piece's graph cut at its collectives."""

    arguments: list[str]  # the piece's placeholders, in argument order
    segments: list[Segment]
    results: list[str]  # the values the piece returns, in order
    last_use: dict[str, int]  # value -> the last segment reading it (len(segments): returned)

    def readers(self) -> dict[int, int]:
        """id of each weight -> how many segment backwards read it (both halves)."""
        count: dict[int, int] = {}
        for segment in self.segments:
            for w in segment.weights:
                count[id(w)] = count.get(id(w), 0) + HALVES
        return count


def cut_at_collectives(gm: fx.GraphModule) -> Cut:
    """Cut ``gm`` (a piece's graph) before and after every ``tp_reduce`` and ``tp_copy``, and
    every sequence collective of Megatron sequence parallelism (``tp_seq=on``)."""
    members: list[list[fx.Node]] = []
    kinds: list[str] = []
    segment_of: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        kind = _collective_kind(node)
        owner = segment_of.get(node.args[0].name) if _unpacks(node) else None
        if kind is None and owner is not None and kinds[owner] == "compute":
            index = owner  # a tuple's item stays with the tuple
        else:
            if kind is not None or not kinds or kinds[-1] != "compute":
                kinds.append(kind or "compute")
                members.append([])
            index = len(members) - 1
        members[index].append(node)
        segment_of[node.name] = index
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    results = [n.name for n in output.args[0]]
    reads: list[list[str]] = [[] for _ in members]
    last_use = {name: len(members) for name in results}
    for index, nodes in enumerate(members):
        for node in nodes:
            for pred in node.all_input_nodes:
                if pred.op != "get_attr" and segment_of.get(pred.name) != index:
                    if pred.name not in reads[index]:
                        reads[index].append(pred.name)
                    last_use[pred.name] = max(last_use.get(pred.name, -1), index)
    segments = []
    for index, (kind, nodes) in enumerate(zip(kinds, members)):
        outputs = [n.name for n in nodes if last_use.get(n.name, index) > index]
        if kind == "compute":
            module = _segment_module(gm, nodes, reads[index], outputs)
            weights = [t for t in itertools.chain(module.parameters(), module.buffers())
                       if t.requires_grad]
            segments.append(Segment(kind, reads[index], outputs, module, weights=weights))
        else:  # a collective's one value, even if nothing reads it (its all-reduce still runs)
            block = nodes[0].args[2] if kind == "tp_seq_gather" else ""
            segments.append(Segment(kind, reads[index], [nodes[0].name],
                                    group=nodes[0].args[1], block=block))
    arguments = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return Cut(arguments, segments, results, last_use)


def _collective_kind(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    if is_tp_reduce(node.target):
        return "reduce"
    if is_tp_copy(node.target):
        return "copy"
    return seq_collective(node.target)  # Megatron sequence parallelism's (tensor/ops_seq.py)


def _unpacks(node: fx.Node) -> bool:
    """An item of a node's value (export's ``split`` then ``getitem``): a tuple cannot cross a
    segment boundary, so an item of a compute node's value is taken where the value is made.
    Only a constant index moves (in graphs traced without export a tensor index is a getitem
    too, and may read values made later)."""
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.all_input_nodes == [node.args[0]])


def _segment_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[str],
                    outputs: list[str]) -> fx.GraphModule:
    new, env = fx.Graph(), {}
    for name in inputs:
        env[name] = new.placeholder(name)
    for node in nodes:
        for pred in node.all_input_nodes:
            if pred.op == "get_attr" and pred.name not in env:
                env[pred.name] = new.node_copy(pred)  # the piece's own parameter or buffer
        env[node.name] = new.node_copy(node, lambda n: env[n.name])
    new.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, new)  # get_attr targets bound to gm's very tensors


class SubPipelined(nn.Module):
    """A piece captured at half the micro-batch, run on whole micro-batches as two halves
    interleaved at every tensor-parallel all-reduce, forward and backward.

    Every argument and result has the batch as its first dimension. With autograd on, the
    piece is one node of the caller's graph whose backward runs the hand-scheduled
    interleaved backward (parameters' gradients accumulate as in a plain backward).
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.cut = cut_at_collectives(gm)
        # Registered so that .parameters() sees the segments' (shared) weights.
        self.parts = nn.ModuleList(s.module for s in self.cut.segments if s.module is not None)

    def forward(self, *args):
        return run_interleaved(self.cut, args)


def subpipeline(piece: Piece) -> Piece:
    """The same piece taking whole micro-batches, run as two interleaved halves.

    ``piece`` must have been built from a graph captured at half the micro-batch; every
    input and output has the batch as its first dimension.
    """
    return Piece(SubPipelined(piece.module), piece.inputs, piece.batch, piece.outputs,
                 piece.params)

