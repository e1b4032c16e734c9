"""What a stage keeps for backward, measured on fake tensors: the partitioner's activations.

Counting each node's output as its saved activation overstates what autograd keeps by
1.3-1.8x (a residual addition saves nothing, a linear layer saves its input, which another
node made) and knows nothing of autocast. Instead the captured graph is run once on fake
tensors (shapes and dtypes only, nothing allocated, so a model larger than memory is
measured too) with autograd on and a saved-tensors hook: every storage autograd saves is
charged, once, to the node whose execution saved it. Parameters are not charged (they are
the stage's states); 16-bit copies of them are (under autocast each matmul saves one, and a
stage enters autocast once per micro-batch, so every in-flight micro-batch keeps its own).

The run happens on the run's device type and precision (:func:`priced_under`): under
``precision=bf16`` / ``fp16`` inside ``torch.autocast``, so each value gets the dtype the
stages will produce (matmul and attention outputs 16-bit; layer norms and an fp32 residual
stream fp32), whatever autocast's op lists are on that device and torch version. The
runtime keeps using the captured graph; only the estimates read these bytes. Where the fake
run fails (an op without a fake kernel; autocast off, as CUDA's is without a GPU), a warning
says so and the output-based count stands: an upper bound, never an underestimate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.parallel.pipeline.capture import ProxyGraph, point_at
from tessera.parallel.pipeline.cost import op_name, value_bytes


@dataclass(frozen=True)
class KeptBytes:
    """A fake run's bytes per node name: ``saved`` what autograd keeps for backward
    (charged to the node that saved it first), ``out`` the node's value."""

    saved: dict[str, int]
    out: dict[str, int]


def priced_under(graph: ProxyGraph, device_type: str, dtype: torch.dtype | None
                 ) -> ProxyGraph:
    """``graph`` whose estimates are measured on ``device_type`` under
    ``torch.autocast(dtype)`` (``None``: no autocast, the captured fp32)."""
    return dataclasses.replace(graph, run_on=(device_type, dtype), kept=None)


def kept_bytes(graph: ProxyGraph) -> KeptBytes | None:
    """The fake run's bytes for ``graph`` (run once, then cached on it); None, with a
    warning, when the graph cannot run on fake tensors."""
    if graph.kept is None:
        device_type, dtype = graph.run_on
        try:
            graph.kept = _fake_run(graph, device_type, dtype)
        except Exception as err:  # whatever the op raised: the output-based count stands
            where = f"torch.autocast({device_type!r}, {dtype})" if dtype else device_type
            warnings.warn(f"stage memory estimated from node outputs (an upper bound): "
                          f"running the captured graph on fake tensors under {where} "
                          f"failed ({type(err).__name__}: {err})", stacklevel=2)
            graph.kept = False
    return graph.kept or None


class _Recorder(fx.Interpreter):
    """Runs a graph on fake tensors, keeping each node's value and the bytes autograd
    saved while it ran."""

    def __init__(self, module: fx.GraphModule, device: torch.device,
                 params: set[int]) -> None:
        super().__init__(module)
        self.device, self.params = device, params
        self.values: dict[str, object] = {}
        self.saved: dict[str, int] = {}
        self.current = ""
        self._seen: set[int] = set()

    def run_node(self, n: fx.Node):
        self.current = n.name
        if n.op == "call_function" and op_name(n) == "access_subclass_inner_tensor":
            # A DTensor parameter's local shard (tensor parallelism): the placeholder is a
            # plain fake of the whole weight here, so the shard is made from its shape, as
            # a view (not a leaf: autocast caches no cast of a shard at run time either).
            base = _fake_like(n.meta.get("val"), self.device, requires_grad=True)
            self.params.add(_storage(base))
            out = base.view(base.shape)
        else:
            out = super().run_node(n)
        self.values[n.name] = out
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in self.params and key not in self._seen:
            self._seen.add(key)
            self.saved[self.current] = (self.saved.get(self.current, 0)
                                        + tensor.untyped_storage().nbytes())
        return tensor


def _fake_run(graph: ProxyGraph, device_type: str, dtype: torch.dtype | None) -> KeptBytes:
    device = torch.device(device_type)
    # The capture may be on the meta device, where autocast casts nothing and kernels are
    # not the run's: a copy of its module pointed at the run's device type (fake tensors
    # allocate nothing there).
    module = point_at(copy.deepcopy(graph.program.graph_module), device)
    params = set(graph.program.graph_signature.inputs_to_parameters)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [_fake_like(n.meta.get("val"), device, requires_grad=n.name in params)
                for n in placeholders]
        recorder = _Recorder(module, device, {_storage(a) for a, n in zip(args, placeholders)
                                              if n.name in params})
        with _autocast(device_type, dtype), \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            if dtype is not None and not torch.is_autocast_enabled(device_type):
                raise RuntimeError(f"torch.autocast({device_type!r}) is disabled here "
                                   "(no such device)")
            recorder.run(*args)
    return KeptBytes(recorder.saved, {name: value_bytes(v) for name, v in
                                      recorder.values.items()})


def _autocast(device_type: str, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    if not torch.amp.is_autocast_available(device_type):
        raise RuntimeError(f"autocast is not available for device type {device_type!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast's own notice; _fake_run's check says it
        return torch.autocast(device_type, dtype=dtype)


def _fake_like(val, device: torch.device, requires_grad: bool = False):
    if isinstance(val, torch.Tensor):
        return torch.empty(val.shape, dtype=val.dtype, device=device,
                           requires_grad=requires_grad and val.is_floating_point())
    return val


def _storage(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (fake storages have no data pointer to compare)."""
    return tensor.untyped_storage()._cdata
