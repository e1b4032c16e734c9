"""Proxy representation: an unmodified model captured as a graph with costs per node.

``torch.export`` traces the model with fake tensors, so a model built on the meta device (one
larger than memory) is captured and partitioned before any weight exists. Nodes fall in kinds:

- ``input``: a batch tensor (``input_ids``). Every stage can read the batch, so inputs are
  fed where they are used (Merak's input-to-shard map) instead of being passed along.
- ``param`` / ``buffer`` / ``const``: lifted model state, held by the stages that use it.
- ``static``: computed from inputs, buffers and constants only (positions, causal masks, RoPE
  tables). Cheap and not learnable, so a stage that needs one recomputes it instead of
  receiving it: nothing but activations crosses a stage boundary.
- ``param_view``: the local shard of a DTensor parameter (tensor parallelism) and views of
  it. Read like the parameter itself: every stage that uses it reads its own copy, so a tied
  weight is tied across stages (not sent as an activation).
- ``compute``: everything else, in topological order; stage boundaries fall between these.
"""

from __future__ import annotations

import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from tessera.models.materialize import BLOCK_LISTS
from tessera.parallel.pipeline.cost import VIEW_OPS, NodeCost, op_name, node_cost, value_bytes
from tessera.parallel.pipeline.leaves import (can_be_leaf, is_leaf_call, leaf_cost, leaf_patterns,
                                              opaque_leaves, suggest_leaves)

_BLOCK_INDEX = re.compile(rf"(?:^|\.)(?:{BLOCK_LISTS})\.(\d+)\.")


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message names the operation and way out."""


@dataclass
class ProxyNode:
    """One node of the captured graph."""

    name: str
    kind: str  # input | param | buffer | const | static | param_view | compute
    node: fx.Node
    fqn: str | None = None  # parameter / buffer name in the original model
    cost: NodeCost = field(default_factory=NodeCost)
    block: int | None = None  # transformer block index, when the node uses a block's weight


@dataclass
class ProxyGraph:
    """A captured model: its exported program and the nodes' kinds and costs.

    Attributes:
        program: the ExportedProgram (lifted graph: state arrives as placeholders).
        nodes: every placeholder and call_function node, by name, in graph order.
        compute: names of the compute nodes in topological order.
        output: name of the node producing the logits (the first user output), or the
            per-token loss when the LM head is sliced.
        inputs: names of the batch-input placeholders, in call order.
        param_users: for each parameter placeholder, the compute indices that read it.
        cut_after: compute nodes after which a cut is allowed although more than the fewest
            activations cross there (between the slices of a sliced LM head, head.py).
        head_slices: vocabulary slices of the LM head (1: the graph outputs whole logits;
            more: it outputs the per-token loss and reads ``labels``).
        run_on: the device type (None: the capture's, the CPU for meta) and autocast dtype
            (None: none) the partition's bytes are measured under (kept.py's
            ``measured_under`` sets them).
        kept: the fake run's bytes, cached by ``kept.kept_bytes``.
    """

    program: ExportedProgram
    nodes: dict[str, ProxyNode]
    compute: list[str]
    output: str
    inputs: list[str]
    param_users: dict[str, list[int]]
    cut_after: frozenset[str] = frozenset()
    head_slices: int = 1
    # Where the estimates' bytes are measured (kept.py): device type and autocast dtype.
    run_on: tuple[str | None, torch.dtype | None] = (None, None)
    kept: Any = field(default=None, repr=False)  # kept.KeptBytes once run; False: failed

    def compute_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.compute)}

    def param_bytes(self, name: str) -> int:
        return value_bytes(self.nodes[name].node.meta.get("val"))

    def input_shape(self) -> tuple[int, ...]:
        """The (B, T) of the input_ids the graph was captured at."""
        return tuple(self.nodes[self.inputs[0]].node.meta["val"].shape)


def capture(model: nn.Module, batch_size: int, seq_len: int, extra_inputs=None,
            head_slices: int = 1) -> ProxyGraph:
    """Capture ``model(input_ids)`` for (batch_size, seq_len) token ids as a ProxyGraph.

    ``extra_inputs(input_ids) -> {name: tensor}``, when given, adds keyword inputs that become
    batch inputs of the graph (sequence parallelism's position ids and token metadata).
    ``head_slices`` > 1 rewrites the LM head into that many vocabulary slices (head.py).

    Works for models on the meta device. A Hugging Face model's ``use_cache`` is off during
    the capture and restored after it (torch.export captures them without the k/v cache;
    transformers 5 dropped fx tracing).

    Raises:
        CaptureError: naming the operation torch.export failed on and the way out.
    """
    device = _model_device(model)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    try:
        kwargs = extra_inputs(ids) if extra_inputs is not None else {}
        with opaque_leaves(model), cache_off(model):  # leaves trace as one node each
            program = torch.export.export(model, (ids,), kwargs, strict=False)
    except Exception as err:  # export raises many types; all mean "not capturable"
        raise CaptureError(_capture_message(model, err, (batch_size, seq_len))) from err
    try:
        graph = build_proxy(program)
    except ValueShapeError as err:  # the way out depends on the module: a leaf, or not
        leaf = err.path and can_be_leaf(model, err.path)
        way_out = (f"mark the module as an opaque leaf, pipeline_leaf_modules="
                   f"{leaf_patterns([err.path])}" if leaf else
                   "make it traceable, or train this model with pp=1 (it is not in a "
                   "module that can run as a leaf)")
        raise CaptureError(f"{err} The way out: {way_out}") from err
    if head_slices > 1:
        from tessera.parallel.pipeline.head import slice_head  # head.py builds on this module

        return slice_head(graph, head_slices)
    return graph


@contextmanager
def cache_off(model: nn.Module):
    """``config.use_cache`` (every Hugging Face config's default is True) off inside for
    ``model`` and any model it wraps, each as it was after: the cache is inference state,
    and its objects do not export."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "use_cache", None)}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def build_proxy(program: ExportedProgram, more_inputs: tuple[str, ...] = (),
                output: str | None = None) -> ProxyGraph:
    """Classify and price the nodes of an exported program.

    ``more_inputs`` and ``output`` name batch inputs and the output of a graph rewritten after
    the export (its signature does not know them).
    """
    sig = program.graph_signature
    kinds = {**{n: "param" for n in sig.inputs_to_parameters},
             **{n: "buffer" for n in sig.inputs_to_buffers},
             **{n: "const" for n in sig.inputs_to_lifted_tensor_constants},
             **{n: "const" for n in sig.inputs_to_lifted_custom_objs},  # leaves' callables
             **{n: "input" for n in sig.user_inputs}}
    fqns = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    nodes: dict[str, ProxyNode] = {}
    compute: list[str] = []
    param_users: dict[str, list[int]] = {n: [] for n in sig.inputs_to_parameters}
    block = None
    roots: dict[str, str] = {}  # param_view node -> its parameter's placeholder
    for node in program.graph.nodes:
        if node.op == "placeholder":
            nodes[node.name] = ProxyNode(node.name, kinds.get(node.name, "input"), node,
                                         fqns.get(node.name))
        elif node.op == "get_attr":  # a submodule of a higher-order op
            nodes[node.name] = ProxyNode(node.name, "const", node)
        elif node.op == "call_function":
            if not node.users and not writes_in_place(node):
                continue  # dead values and metadata asserts: nothing to run
            preds = [nodes[a.name] for a in node.all_input_nodes]
            root = _viewed_param(node, preds)
            if root is not None:
                nodes[node.name] = ProxyNode(node.name, "param_view", node, root.fqn)
                roots[node.name] = roots.get(root.name, root.name)
                continue
            if all(p.kind in ("input", "buffer", "const", "static") for p in preds):
                nodes[node.name] = ProxyNode(node.name, "static", node)
                continue
            block = _block_of(node, preds, block)
            cost = _priced(node, preds)
            nodes[node.name] = ProxyNode(node.name, "compute", node, cost=cost, block=block)
            for pred in preds:
                if pred.kind in ("param", "param_view"):
                    param_users[roots.get(pred.name, pred.name)].append(len(compute))
            compute.append(node.name)
    output = output or _logits_node(program, nodes)
    inputs = list(sig.user_inputs) + list(more_inputs)
    return ProxyGraph(program, nodes, compute, output, inputs, param_users)


def writes_in_place(node: fx.Node) -> bool:
    """Whether the node's op writes into one of its inputs (``x[:, i] = ...`` exports as a
    ``copy_`` that nothing reads): kept as a compute node, or a stage built from the graph
    would lose the write (it did: OLMo-Hybrid's exported forward substitution)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = op_name(node)
    return name.endswith("_") and not name.startswith("_")


def _priced(node: fx.Node, preds: list[ProxyNode]) -> NodeCost:
    """The node's cost; a shape that depends on tensor values (torch.export captures
    ``nonzero`` with an unknown row count) is refused, naming the module, as a capture that
    cannot be priced or cut."""
    try:
        if is_leaf_call(node):
            return leaf_cost(node, sum(p.node.meta["val"].numel() for p in preds
                                       if p.kind in ("param", "param_view")))
        return node_cost(node)
    except GuardOnDataDependentSymNode as err:
        path = module_of(node)
        where = (node.meta.get("stack_trace") or "").strip().splitlines()
        raise ValueShapeError(
            f"{node.name} ({op_name(node)}) in module {path or 'the model itself'!r} has a "
            f"shape that depends on tensor values ({str(err).splitlines()[0]}"
            f"{'; ' + where[-1].strip() if where else ''}): stages cannot be priced or cut "
            f"around it.", path) from err


def module_of(node: fx.Node) -> str:
    """The innermost module that computes ``node`` ("" for the model's own forward), from
    the module path torch.export records on every node."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


class ValueShapeError(CaptureError):
    """A captured node whose shape depends on tensor values; ``path``: its module."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def _viewed_param(node: fx.Node, preds: list[ProxyNode]) -> ProxyNode | None:
    """The parameter (or shard view) ``node`` is a shard or view of, else None."""
    if len(preds) != 1 or preds[0].kind not in ("param", "param_view"):
        return None
    name = op_name(node)
    if name == "access_subclass_inner_tensor":
        return preds[0]
    return preds[0] if preds[0].kind == "param_view" and name in VIEW_OPS else None


def _block_of(node: fx.Node, preds: list[ProxyNode], current: int | None) -> int | None:
    """The index of the block that computes ``node``, None outside blocks.

    The modules torch.export records decide, innermost first: a block's norm starts with ops
    that read no weight (RMSNorm's pow, mean, rsqrt), and they belong to that block, not to
    the one before (which would leave no block boundary for recomputation to cut at); a
    module shared by the blocks (a model-level RoPE) runs inside the block calling it. Other
    nodes (the model's own forward, a container's loop adding each block's output to the
    residual, a leaf call) take the block of the weight they read, else the node before's."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        match = _BLOCK_INDEX.search(f".{path}.")
        if match:
            return int(match.group(1))
    for pred in preds:
        if pred.kind in ("param", "param_view"):
            match = _BLOCK_INDEX.search("." + pred.fqn)
            return int(match.group(1)) if match else None
    return current


def _logits_node(program: ExportedProgram, nodes: dict[str, ProxyNode]) -> str:
    sig = program.graph_signature
    if sig.buffers_to_mutate:
        raise CaptureError("the model mutates buffers in forward "
                           f"({', '.join(sig.buffers_to_mutate.values())}); pipeline stages "
                           "need a pure forward")
    name = sig.user_outputs[0]
    if nodes.get(name) is None or nodes[name].kind != "compute":
        raise CaptureError(f"the model's first output {name!r} is not computed from its "
                           "weights; expected logits")
    ids = nodes[sig.user_inputs[0]].node.meta["val"].shape  # (B, T)
    shape = tuple(getattr(nodes[name].node.meta.get("val"), "shape", ()))
    if len(shape) != 3 or shape[:2] != tuple(ids):
        raise CaptureError(
            f"the model's first output {name!r} has shape {shape}, not logits "
            f"({ids[0]}, {ids[1]}, vocab) for input_ids of shape {tuple(ids)}: pipeline "
            "stages train on the logits' next-token loss. A Mixture-of-Experts model with "
            "output_router_logits=True returns its router loss first (and tessera would not "
            "add it): build it with output_router_logits=False")
    return name


def retarget(graph: ProxyGraph, device: torch.device) -> ProxyGraph:
    """Point the ops of a capture made on the meta device that name it (``arange``,
    ``new_ones``, ``to``, ...) at ``device``, where the stages built from it run."""
    point_at(graph.program.graph_module, device)
    return graph


def point_at(graph_module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Rewrite, in place, the meta-device arguments of ``graph_module``'s ops (and of its
    higher-order ops' subgraphs: autocast, set_grad_enabled) to ``device``; returns it."""
    meta = torch.device("meta")

    def swap(value):
        if isinstance(value, torch.device) and value == meta:
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.args = swap(node.args)
                node.kwargs = {key: swap(value) for key, value in node.kwargs.items()}
            module.recompile()
    return graph_module


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    """Frames outside torch in the traceback of ``err`` or, when torch re-raised it from
    its own frames only, of the exceptions it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if "site-packages/torch" not in f.filename and "/torch/" not in f.filename
                  and not f.filename.endswith("pipeline/capture.py")]
        if frames:
            return frames
        err = err.__cause__ or err.__context__
    return []


def _capture_message(model: nn.Module, err: Exception, shape: tuple[int, int]) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    frames = _user_frames(err)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    head = (f"torch.export could not capture {type(model).__name__} for pipeline "
            f"partitioning: {type(err).__name__}: {first}{where}. ")
    leaves = suggest_leaves(model, err)
    if leaves:  # the failing operation is inside a submodule: run that module eagerly
        way_out = (f"The way out: mark the module that runs it as an opaque leaf, "
                   f"pipeline_leaf_modules={leaves} (train.pipeline_leaf_modules in YAML): it "
                   "then runs eagerly inside its stage, and stages are cut between whole "
                   "leaves, by the partitioner or at the pipeline_split_points you name. "
                   "Or train this model with pp=1.")
    else:
        way_out = ("It is in the model's own forward, which no leaf module can hide: make it "
                   "traceable, or train this model with pp=1.")
    if "Cache" in f"{type(err).__name__} {err}":  # a k/v cache object reached the export
        way_out = ("A Hugging Face k/v cache was in the traced call: build the model with "
                   "use_cache=False (a model this wraps, too), or pass use_cache=False in "
                   "its forward. " + way_out)
    if _data_dependent(err):
        return (head + "Data-dependent control flow (a Python `if` on a tensor value) cannot "
                "be traced: rewrite it with torch.cond, or take the way out below. " + way_out)
    return (head + f"It was traced with input_ids of shape {shape}: if the model rejects "
            "that input (a sequence longer than it accepts), run with a shape it takes. "
            + way_out)


def _data_dependent(err: BaseException | None) -> bool:
    """Whether export failed on a value it cannot know while tracing (a branch on a tensor,
    ``.item()``), in ``err`` or the exceptions it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, GuardOnDataDependentSymNode) or "data-dependent" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False
