"""What a stage keeps for backward, measured on fake tensors: the partitioner's activations.

Counting each node's output as its saved activation overstates what autograd keeps by
1.3-1.8x (a residual addition saves nothing, a linear layer saves its input, which another
node made) and knows nothing of autocast. Instead the captured graph is run once on fake
tensors (shapes and dtypes only, nothing allocated, so a model larger than memory is
measured too) with autograd on and a saved-tensors hook: every storage autograd saves is
charged to the nodes whose execution saved it. Parameters, buffers and constants are not
charged (they are the stage's state); 16-bit copies of parameters are: under autocast each
matmul saves one, and as a stage enters autocast once per micro-batch, every in-flight
micro-batch keeps its own, unless the step shares them (``CostTable.memory``, from the
copies' bytes here, PipelineProgram.step_casts).

The run happens on the run's device type and precision (``measured_under``; the pipeline
sets them from the strategy): under ``precision=bf16`` / ``fp16`` inside ``torch.autocast``,
so each value gets the dtype the stages will produce (matmul and attention outputs 16-bit;
layer norms and an fp32 residual stream fp32), whatever autocast's op lists are on that
device and torch version. Each storage is reported with every node that saved it: a tensor
saved on both sides of a stage cut (a sliced head's hidden state, RoPE tables) is held by
each stage that saves it, and the CostTable prices it so. The runtime keeps using the
captured graph; only the estimates read these bytes. Where the fake run fails (an op without
a fake kernel; autocast off, as CUDA's is without a GPU) a warning says so and each node's
output counts instead (1.3-1.8x what autograd keeps in fp32 in the models measured, but
without the weights' 16-bit copies under autocast).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.parallel.pipeline.capture import ProxyGraph, point_at
from tessera.parallel.pipeline.cost import op_name, value_bytes
from tessera.parallel.pipeline.shard_casts import LOWER_PRECISION_OPS, is_layout


@dataclass(frozen=True)
class KeptBytes:
    """A fake run's bytes: ``storages`` each storage autograd keeps for backward as (bytes,
    names of the nodes that saved it, in run order); ``out`` each node's value, by name;
    ``cast_of`` for the storages (by index) that are autocast's 16-bit copy of a node's own
    value, that node's name.

    In the whole graph each reader casts a value anew, but a stage's inputs are leaves, whose
    casts autocast caches: the three projections reading a normed hidden state received from
    the previous stage share one copy (the CostTable counts it once there)."""

    storages: list[tuple[int, tuple[str, ...]]]
    out: dict[str, int]
    cast_of: dict[int, str] = dataclasses.field(default_factory=dict)


def measured_under(graph: ProxyGraph, device_type: str | None, dtype: torch.dtype | None
                   ) -> ProxyGraph:
    """``graph`` whose estimates are measured on ``device_type`` (None: the capture's own;
    the CPU for a capture on meta) under ``torch.autocast(dtype)`` (None: no autocast)."""
    return dataclasses.replace(graph, run_on=(device_type, dtype), kept=None)


def kept_bytes(graph: ProxyGraph) -> KeptBytes | None:
    """The fake run's bytes for ``graph`` (run once, then cached on it); None, with a
    warning, when the graph cannot run on fake tensors."""
    if graph.kept is None:
        device_type, dtype = graph.run_on
        try:
            with _quiet_fake_tensors():
                graph.kept = _fake_run(graph, device_type, dtype)
        except Exception as err:  # whatever the op raised: the output-based count stands
            where = (f"torch.autocast({device_type!r}, {dtype})" if dtype
                     else device_type or "the capture's device")
            warnings.warn(f"stage memory estimated from each node's output instead of what "
                          f"autograd keeps (1.3-1.8x that in fp32 in the models measured; "
                          f"under autocast it misses the weights' 16-bit copies): running "
                          f"the captured graph on fake tensors on {where} failed "
                          f"({type(err).__name__}: {_first_line(err)})", stacklevel=2)
            graph.kept = False
    return graph.kept or None


class _Recorder(fx.Interpreter):
    """Runs a graph on fake tensors, keeping each node's value and the bytes autograd
    saved while it ran."""

    def __init__(self, module: fx.GraphModule, device: torch.device, held: set[int],
                 autocast_dtype: torch.dtype | None) -> None:
        super().__init__(module)
        self.device = device
        self.autocast_dtype = autocast_dtype  # the run's 16-bit dtype under autocast
        self.held = held  # storages of the stage's state (parameters, buffers, constants)
        self.values: dict[str, object] = {}
        self.savers: dict[int, list] = {}  # storage -> [bytes, saver names...]
        self.current = self.current_op = ""
        self.named: dict[int, str] = {}  # id of a node's value -> the node's name
        self.converting = False  # running a node that converts dtypes itself (.to, .float)
        self.cast_of: dict[int, str] = {}  # storage of a 16-bit copy -> node copied
        # A tensor-parallel shard and its layout views -> the parameter's placeholder: a 16-bit
        # op's copy of one is a copy of that weight (shared per step, shard_casts.py).
        self.weight_of: dict[str, str] = {}
        self.copies: list[torch.Tensor] = []  # alive, so their storages' ids stay theirs
        from tessera.parallel.tensor.ops2d import AUTOCAST_OUTPUT  # custom linear ops
        self.autocast_output = AUTOCAST_OUTPUT

    def run_node(self, n: fx.Node):
        self.current, self.current_op = n.name, op_name(n)
        # A 2D linear's op (and tp_seq's column op) casts its input itself, for the product
        # and for what it keeps: its copies are its own, never autocast's shared ones.
        self.converting = n.op == "call_function" and (
            op_name(n) in _CONVERSIONS or n.target in self.autocast_output)
        if n.op == "call_function" and op_name(n) == "access_subclass_inner_tensor":
            # A DTensor parameter's local shard (tensor parallelism): the placeholder is a
            # plain fake of the whole weight here, so the shard is made from its shape, as
            # a view (not a leaf: its copies are named after the weight, see note_cast).
            base = _fake_like(n.meta.get("val"), self.device, requires_grad=True)
            self.held.add(_storage(base))
            out = base.view(base.shape)
            self.weight_of[n.name] = n.args[0].name
        elif n.op == "call_function" and op_name(n) == "_assert_tensor_metadata":
            # The capture's dtype checks hold for its fp32 trace, not for autocast's 16-bit
            # values (a RoPE's q.float() asserts its input fp32); they keep nothing.
            out = None
        else:
            out = super().run_node(n)
            if n.target in self.autocast_output and torch.is_autocast_enabled(out.device.type):
                out = out.to(torch.get_autocast_dtype(out.device.type))  # as the real op's
        reads = n.all_input_nodes
        if is_layout(n) and reads and reads[0].name in self.weight_of:
            self.weight_of[n.name] = self.weight_of[reads[0].name]
        self.values[n.name] = out
        if isinstance(out, torch.Tensor):
            # The first node that made it: a no-op ``.to`` returns its input object.
            self.named.setdefault(id(out), n.name)
        return out

    def note_cast(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` is ``source`` converted; kept when it is autocast's own 16-bit copy of
        an fp32 value (the only casts autocast's cache shares), not the graph's conversion."""
        name = self.named.get(id(source))
        if self.current_op in LOWER_PRECISION_OPS:  # the reads shard_casts.py shares
            name = self.weight_of.get(name, name)
        if (name is None or self.converting or not isinstance(copy, torch.Tensor)
                or source.dtype != torch.float32 or copy.dtype != self.autocast_dtype):
            return
        self.cast_of.setdefault(_storage(copy), name)
        self.copies.append(copy)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in self.held:
            savers = self.savers.setdefault(key, [tensor.untyped_storage().nbytes()])
            if self.current not in savers[1:]:
                savers.append(self.current)
        return tensor


def _first_line(err: Exception) -> str:
    """The error's message without the graph interpreter's appended node and traceback."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Silence torch's own error log of a failing fake kernel (a page of traceback for
    Mixtral's ``histc`` on int32): the warning above names the failure in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_run(graph: ProxyGraph, device_type: str | None, dtype: torch.dtype | None
              ) -> KeptBytes:
    device = _run_device(graph, device_type)
    # The capture may be on the meta device, where autocast casts nothing and kernels are
    # not the run's: a copy of its module pointed at the run's device type (fake tensors
    # allocate nothing there).
    with warnings.catch_warnings():  # torch deprecates a class its own leaf-call specs copy
        warnings.filterwarnings("ignore", ".*LeafSpec.* is deprecated", FutureWarning)
        module = point_at(copy.deepcopy(graph.program.graph_module), device)
    sig = graph.program.graph_signature
    params = set(sig.inputs_to_parameters)
    state = params | set(sig.inputs_to_buffers) | set(sig.inputs_to_lifted_tensor_constants)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        objs = sig.inputs_to_lifted_custom_objs  # leaf modules' callables (leaves.py)
        args = [graph.program.constants[objs[n.name]] if n.name in objs
                else _fake_like(n.meta.get("val"), device, requires_grad=n.name in params)
                for n in placeholders]
        held = {_storage(a) for a, n in zip(args, placeholders)
                if n.name in state and isinstance(a, torch.Tensor)}
        recorder = _Recorder(module, device, held, dtype)
        with _autocast(device.type, dtype), _CastWatch(recorder), \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            if dtype is not None and not torch.is_autocast_enabled(device.type):
                raise RuntimeError(f"torch.autocast({device.type!r}) is disabled on this "
                                   "machine")
            recorder.run(*args)
    storages, cast_of = [], {}
    for key, entry in recorder.savers.items():
        if key in recorder.cast_of:
            cast_of[len(storages)] = recorder.cast_of[key]
        storages.append((entry[0], tuple(entry[1:])))
    return KeptBytes(storages, {name: value_bytes(v) for name, v in recorder.values.items()},
                     cast_of)


# Ops that convert dtypes as the graph asks (their copies are not autocast's, never shared).
_CONVERSIONS = {"to", "_to_copy", "type_as", "type", "float", "half", "bfloat16"}


class _CastWatch(TorchDispatchMode):
    """Tells the recorder which conversions copy a node's own value (autocast's casts reach
    the dispatcher as ``_to_copy``), so that stage inputs' shared casts can be priced."""

    # Higher-order ops (an opaque leaf module's call, leaves.py) pass through as themselves:
    # the fake mode below runs them.
    supports_higher_order_operators = True

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            self.recorder.note_cast(args[0], out)
        return out


def _run_device(graph: ProxyGraph, device_type: str | None) -> torch.device:
    """The device type to run on: the one asked, else the capture's (the CPU for meta)."""
    if device_type is None:
        val = next((n.meta.get("val") for n in graph.program.graph.nodes
                    if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)),
                   None)
        device_type = "cpu" if val is None or val.device.type == "meta" else val.device.type
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available here to run the graph as the stages will")
    return torch.device(device_type)


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
