"""Activation bytes under mixed precision, for the partitioner's stage memory.

The graph is captured without autocast, so every value in it is fp32. Under ``precision=bf16``
(or fp16) each stage runs its micro-batches inside ``torch.autocast``: matmul and attention
outputs become 16-bit, ops that autocast keeps in fp32 (layer norm, softmax, the residual
additions fed by an fp32 stream) stay fp32, and each matmul saves for its backward a 16-bit
copy of its fp32 weight (not of a tensor-parallel shard: see ``_weight_copies``). A stage enters autocast once per micro-batch forward and autocast
frees its weight cache on exit, so every in-flight micro-batch holds its own copies (they are
activations in all but name, and a recomputed segment drops them too).

Rather than list autocast's rules (they differ between devices and torch versions), the
graph is run once on fake tensors under the run's own autocast: each node's value then has
the dtype the stages will produce. :func:`under_autocast` returns the graph with its costs'
bytes re-counted from those values; the runtime keeps using the captured graph.

A matmul also saves a 16-bit copy of an fp32 input (autocast caches weights only). Those are
not added: the base count (each node's output) already exceeds what autograd keeps by
1.3-1.8x, and adding them moved the estimate's bf16 / fp32 ratio away from the measured one
(docs/pipeline.md, *Recomputation, stage-aware*, gives both against autograd's bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.parallel.pipeline.capture import ProxyGraph, point_at
from tessera.parallel.pipeline.cost import matmul_flops, op_name, value_bytes


def under_autocast(graph: ProxyGraph, device_type: str, dtype: torch.dtype) -> ProxyGraph:
    """``graph`` with its compute nodes' bytes as they are under ``torch.autocast``.

    Each compute node's ``out_bytes`` is its value's bytes in the dtype autocast gives it;
    its ``saved_bytes`` scales likewise, plus the 16-bit weight copies a matmul keeps for its
    backward (once per weight). When the graph cannot be run on fake tensors (a custom op
    without a fake kernel), a warning says so and the fp32 bytes are kept: the estimate is
    then an upper bound, never an underestimate.
    """
    try:
        values = _fake_run(graph, device_type, dtype)
    except Exception as err:  # whatever the op raised: the fp32 estimate still stands
        warnings.warn(f"stage memory estimated with fp32 activations: running the captured "
                      f"graph under torch.autocast({device_type!r}, {dtype}) on fake tensors "
                      f"failed ({type(err).__name__}: {err})", stacklevel=2)
        return graph
    nodes = dict(graph.nodes)
    copied: set[str] = set()
    for name in graph.compute:
        proxy = nodes[name]
        cost, out = proxy.cost, value_bytes(values.get(name))
        saved = cost.saved_bytes * out / cost.out_bytes if cost.out_bytes else cost.saved_bytes
        saved += _weight_copies(graph, proxy.node, values, copied)
        nodes[name] = dataclasses.replace(
            proxy, cost=dataclasses.replace(cost, out_bytes=out, saved_bytes=round(saved)))
    return dataclasses.replace(graph, nodes=nodes)


def _weight_copies(graph: ProxyGraph, node: fx.Node, values: dict, copied: set[str]) -> int:
    """Bytes of the 16-bit copies of fp32 weights that matmul ``node`` casts and saves for
    its backward, each weight counted at its first caster (autocast caches a weight's cast
    within one forward)."""
    out = values.get(node.name)
    if not isinstance(out, torch.Tensor) or not matmul_flops(node):
        return 0
    total = 0
    for pred in node.all_input_nodes:
        # A tensor-parallel shard (param_view) is not a leaf: autocast caches no cast of it,
        # and tessera's tp ops keep the fp32 shard for their backward (planner.md counts it).
        if graph.nodes[pred.name].kind != "param" or pred.name in copied:
            continue
        weight = pred.meta.get("val")
        if isinstance(weight, torch.Tensor) and weight.is_floating_point() \
                and weight.dtype != out.dtype:
            copied.add(pred.name)
            total += weight.numel() * out.element_size()
    return total


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value (fake tensors: shapes and dtypes only)."""

    def __init__(self, module: fx.GraphModule, device: torch.device) -> None:
        super().__init__(module)
        self.device = device
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and op_name(n) == "access_subclass_inner_tensor":
            # A DTensor parameter's local shard (tensor parallelism): the placeholder is a
            # plain fake of the whole weight here, so the shard is made from its shape.
            out = _fake_like(n.meta.get("val"), self.device)
        else:
            out = super().run_node(n)
        self.values[n.name] = out
        return out


def _fake_run(graph: ProxyGraph, device_type: str, dtype: torch.dtype) -> dict[str, object]:
    """Each node's value when the captured graph runs under autocast on ``device_type``."""
    if not torch.amp.is_autocast_available(device_type):
        raise RuntimeError(f"autocast is not available for device type {device_type!r}")
    device = torch.device(device_type)
    # The capture may be on the meta device, where autocast casts nothing: a copy of its
    # module pointed at the run's device type (fake tensors allocate nothing there).
    module = point_at(copy.deepcopy(graph.program.graph_module), device)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [_fake_like(n.meta.get("val"), device) for n in placeholders]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # autocast's own notice; the check below says it
            autocast = torch.autocast(device_type, dtype=dtype)
        with autocast:
            if not torch.is_autocast_enabled(device_type):  # e.g. cuda without a GPU
                raise RuntimeError(f"torch.autocast({device_type!r}) is disabled here")
            recorder = _Recorder(module, device)
            recorder.run(*args)
    return recorder.values


def _fake_like(val, device: torch.device):
    if isinstance(val, torch.Tensor):
        return torch.empty(val.shape, dtype=val.dtype, device=device)
    return val
