"""Cut a captured graph into runnable pieces, one fx GraphModule per piece.

Pieces are consecutive groups of compute nodes (a pipeline stage is one piece, or two when part
of it is recomputed). The values entering piece p are those produced before p and read at or
after p: a skip connection that jumps over a stage passes through it (it is an input and an
output of the stage in between), so only neighbouring stages exchange messages. Static values
(positions, masks, RoPE tables) are recomputed in every piece that reads them, and batch
inputs are read directly, so boundaries carry activations only.

Parameters and buffers are bound by attribute, to the very tensors of the original model: a
piece's gradients land in the model's parameters, and the optimizer and checkpoints see the
original names. A weight this rank holds only as rows (``rows.py``) is bound to those rows,
and the piece's row slices of it are shifted to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.pipeline.comm import TensorSpec
from tessera.parallel.pipeline.rows import row_slice
from tessera.parallel.pipeline.shard_casts import dtensor_local, read_casts_of_shards

# weight name -> (this rank's rows of it, the first row's index): see rows.py
RowBindings = dict[str, tuple[torch.Tensor, int]]


@dataclass
class Piece:
    """One runnable part of the graph.

    Attributes:
        module: ``module(*boundary_inputs, *batch_inputs) -> tuple(outputs)``.
        inputs: names of the activations it receives, in argument order.
        batch: names of the batch inputs it reads (e.g. ``input_ids``), after ``inputs``.
        outputs: names of the values it returns (the logits for the last piece).
        params: names (as in the export) of the parameters it reads.
    """

    module: fx.GraphModule
    inputs: list[str]
    batch: list[str]
    outputs: list[str]
    params: list[str]

    def input_specs(self, graph: ProxyGraph) -> list[TensorSpec]:
        return [spec_of(graph, n) for n in self.inputs]

    def output_specs(self, graph: ProxyGraph) -> list[TensorSpec]:
        return [spec_of(graph, n) for n in self.outputs]


def spec_of(graph: ProxyGraph, name: str) -> TensorSpec:
    val = graph.nodes[name].node.meta["val"]
    return TensorSpec(tuple(val.shape), val.dtype)


def boundaries(graph: ProxyGraph, groups: list[list[str]]) -> list[list[str]]:
    """Values entering each group: produced by an earlier group, read by this or a later one.

    The logits count as read after the last group, so they pass through to the end.
    """
    piece_of = {name: p for p, group in enumerate(groups) for name in group}
    last_use: dict[str, int] = {}
    for p, group in enumerate(groups):
        for name in group:
            for pred in graph.nodes[name].node.all_input_nodes:
                if pred.name in piece_of:
                    last_use[pred.name] = max(last_use.get(pred.name, -1), p)
    last_use[graph.output] = len(groups)
    order = graph.compute_index()
    out = []
    for p in range(len(groups)):
        names = [n for n, last in last_use.items() if piece_of[n] < p <= last]
        out.append(sorted(names, key=order.__getitem__))
    return out


def split_graph(graph: ProxyGraph, groups: list[list[str]], model: nn.Module,
                rows: RowBindings | None = None, only: set[int] | None = None
                ) -> list[Piece | None]:
    """One :class:`Piece` per group of compute nodes (groups in graph order, together all).

    With ``only``, just those pieces are built (the others are None): a rank builds its own
    stages, whose weights it holds. Weights named in ``rows`` are bound to this rank's rows.
    """
    entering = boundaries(graph, groups)
    pieces: list[Piece | None] = []
    for p, group in enumerate(groups):
        if only is not None and p not in only:
            pieces.append(None)
            continue
        outputs = entering[p + 1] if p + 1 < len(groups) else [graph.output]
        pieces.append(_build_piece(graph, group, entering[p], outputs, model, rows or {}))
    return pieces


def _needed(graph: ProxyGraph, group: list[str], inputs: list[str]) -> set[str]:
    """The group's nodes plus the non-compute nodes they read (transitively through statics)."""
    needed, stack = set(group), list(group)
    boundary = set(inputs)
    while stack:
        for pred in graph.nodes[stack.pop()].node.all_input_nodes:
            if pred.name in needed or pred.name in boundary:
                continue
            if graph.nodes[pred.name].kind == "compute":
                raise ValueError(f"{pred.name} is read but neither inside nor entering the piece")
            needed.add(pred.name)
            stack.append(pred.name)
    return needed


def _build_piece(graph: ProxyGraph, group: list[str], inputs: list[str], outputs: list[str],
                 model: nn.Module, rows: RowBindings) -> Piece:
    needed = _needed(graph, group, inputs)
    new, env, root = fx.Graph(), {}, {}
    row_start: dict[str, int] = {}  # weights bound to this rank's rows -> first row held
    for name in inputs:
        env[name] = new.placeholder(name)
    batch = [n for n in graph.inputs if n in needed]
    for name in batch:
        env[name] = new.placeholder(name)
    params = []
    for node in graph.program.graph.nodes:
        if node.name not in needed or node.name in env:
            continue
        proxy = graph.nodes[node.name]
        if node.op in ("placeholder", "get_attr"):
            bound = rows.get(proxy.fqn) if proxy.kind == "param" else None
            root[node.name] = bound[0] if bound else _state_value(graph, proxy, model)
            env[node.name] = new.get_attr(node.name)
            if bound:
                row_start[node.name] = bound[1]
            if proxy.kind == "param":
                params.append(node.name)
        elif any(a.name in row_start for a in node.all_input_nodes):
            env[node.name] = _shifted_slice(new, node, env, row_start)
        elif _is_local_shard(node):
            # export reads a DTensor parameter's shard with an op autograd does not see
            # through; to_local() carries the gradient back to the parameter.
            env[node.name] = new.call_function(dtensor_local, (env[node.args[0].name],))
        else:
            env[node.name] = new.node_copy(node, lambda n: env[n.name])
    new.output(tuple(env[n] for n in outputs))
    read_casts_of_shards(new)  # one 16-bit copy of a shard per step where shared
    return Piece(fx.GraphModule(root, new), inputs, batch, outputs, params)


def _shifted_slice(new: fx.Graph, node: fx.Node, env: dict, row_start: dict[str, int]
                   ) -> fx.Node:
    """``W[lo:hi]`` read from this rank's rows of W, which start at row ``row_start``."""
    span, weight = row_slice(node), node.args[0]
    if span is None or weight.name not in row_start:
        raise RuntimeError(f"{node.name} ({node.target}) reads a weight this rank holds only "
                           "as rows, other than by a row slice (pipeline/rows.py)")
    start = row_start[weight.name]
    out = new.call_function(torch.ops.aten.slice.Tensor,
                            (env[weight.name], 0, span[0] - start, span[1] - start))
    out.meta = dict(node.meta)  # the same (hi - lo, ...) value as the original slice
    return out


def _is_local_shard(node: fx.Node) -> bool:
    inner = getattr(torch.ops.export, "access_subclass_inner_tensor", None)
    return (inner is not None and node.target is inner.default
            and node.args[1:] == ("_local_tensor",))


def _state_value(graph: ProxyGraph, proxy, model: nn.Module):
    """The model's own tensor (or the export's constant / submodule) behind a state node."""
    sig = graph.program.graph_signature
    if proxy.kind == "param":
        return model.get_parameter(proxy.fqn)
    if proxy.kind == "buffer":
        return model.get_buffer(proxy.fqn)
    if proxy.node.op == "get_attr":
        return getattr(graph.program.graph_module, proxy.node.target)
    if proxy.name in sig.inputs_to_lifted_custom_objs:  # a leaf module's callable (leaves.py)
        return graph.program.constants[sig.inputs_to_lifted_custom_objs[proxy.name]]
    return graph.program.constants[sig.inputs_to_lifted_tensor_constants[proxy.name]]
