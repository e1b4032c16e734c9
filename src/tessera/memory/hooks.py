"""Module and autograd hooks that drive tensor states and chunk movement.

- pre-forward of a module with parameters: its chunks come to the device (all-gathered under
  ZeRO), its tensors go to COMPUTE; a moment ticks.
- post-forward: tensors go to HOLD_AFTER_FWD (HOLD without gradients); once a whole ZeRO group
  is done, its remote payloads are released. The outputs pass through an identity autograd
  function whose backward is the module's pre-backward hook.
- pre-backward: the chunks come back to the device, tensors to COMPUTE; a moment ticks.
- post-accumulate-grad of each parameter: the gradient is added into its gradient chunk and
  dropped; the tensor goes to HOLD_AFTER_BWD; a finished group is reduce-scattered.
- recomputation (activation checkpointing): a block's forward running again inside backward
  brings its chunks back and marks them COMPUTE, then HOLD_AFTER_FWD, releasing nothing.
- saved tensors: a tensor autograd saves that views a chunk is stored as (parameter, offset,
  shape, stride) and rebuilt from the parameter's current payload at backward, so chunks can
  move or be released between forward and backward; any other saved tensor is non-model memory
  and counted by the tracer while it is saved.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from tessera.memory.chunk import Chunk, Kind
from tessera.memory.manager import ChunkManager
from tessera.memory.shards import local_grad, local_of
from tessera.memory.tensor_state import TensorState
from tessera.memory.tiers import DEVICE, HOST

S = TensorState


class ChunkHooks:
    """Installs the hooks on ``model`` and implements what each one does."""

    def __init__(self, manager: ChunkManager, model: nn.Module) -> None:
        self.m = manager
        # group -> parameters whose gradient was stored since the group last finished. A set,
        # not a count: a pipeline stage's pieces may each hold part of a group, and a piece's
        # next micro-batch may deliver a gradient before another piece delivered its first.
        self.arrived: dict[int, set[int]] = {}
        self.pending: set[int] = set()  # groups with gradients not yet reduce-scattered
        # Tensors that finished forward since the last backward, per group. Release decisions
        # use these counts, which every rank shares, not the local states of remote tensors
        # (those differ between ranks after a re-gather, e.g. for a tied weight).
        self.fwd_done: dict[int, set[int]] = {}
        self.phase = "fwd"
        self.busy: set[int] = set()  # ids of parameters in backward use during a recompute
        self.handles = []
        self._saved_ctx = None
        for name, module in model.named_modules():
            self.hook_module(name or "root", module)
        for param in manager.slot_of:
            self.handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        self.watch_saved(model)

    def hook_module(self, name: str, module: nn.Module, recurse: bool = False) -> bool:
        """Drive the chunks of the parameters ``module`` owns directly (with ``recurse``,
        also through its submodules) around its forward (and, through its outputs, its
        backward). Returns whether it owns any."""
        params = [p for p in module.parameters(recurse=recurse) if p in self.m.slot_of]
        if params:
            self.handles.append(module.register_forward_pre_hook(
                functools.partial(self._pre_forward, name, params)))
            self.handles.append(module.register_forward_hook(
                functools.partial(self._post_forward, name, params)))
        return bool(params)

    def watch_saved(self, module: nn.Module) -> None:
        """Route what autograd saves inside ``module``'s forward through the chunk
        saved-tensor hooks (views of chunks as references, the rest counted)."""
        self.handles.append(module.register_forward_pre_hook(self._enter_saved))
        self.handles.append(module.register_forward_hook(self._exit_saved, always_call=True))

    # ------------------------------------------------------------------------- forward
    def _pre_forward(self, name: str, params: list, module: nn.Module, args: Any) -> None:
        if _in_backward():  # a recomputed block (activation checkpointing) runs forward again
            # Tensors whose backward already began (their pre-backward ran first) stay COMPUTE.
            self.busy.update(id(p) for p in params
                             if self.m.slot_of[p][1].state is S.COMPUTE)
            self.use(params, f"rfw {name}", scheduled=True)
            return
        self.use(params, f"fwd {name}", scheduled=torch.is_grad_enabled())

    def _post_forward(self, name: str, params: list, module: nn.Module, args: Any,
                      output: Any) -> Any:
        grad = torch.is_grad_enabled()
        if _in_backward():
            # Recomputation: the backward that follows uses these parameters again, so no
            # ZeRO release here; its graph is discarded, so no pre-backward hook either.
            for p in params:
                if id(p) not in self.busy:
                    self.m.set_state_of(p, S.HOLD_AFTER_FWD)
            self.busy.difference_update(id(p) for p in params)
            return output
        self.done_forward(params, grad)
        if not grad:
            return output
        if isinstance(output, torch.Tensor):
            return _PreBackward.apply(self, name, params, output)[0]
        if isinstance(output, tuple) and all(isinstance(t, torch.Tensor) for t in output):
            return tuple(_PreBackward.apply(self, name, params, *output))
        raise TypeError(f"memory=chunk: module {name} ({type(module).__name__}) returns "
                        f"{type(output).__name__}; modules owning parameters must return "
                        "tensors so their backward can be hooked")

    def use(self, params: list, label: str, scheduled: bool) -> None:
        """Bring the chunks of ``params`` to the device and mark the tensors COMPUTE."""
        m = self.m
        if label.startswith("bwd"):
            self.phase = "bwd"
        elif label.startswith("fwd") and self.phase == "bwd":  # next micro-batch
            self.phase = "fwd"
            self.fwd_done.clear()
        moment = m.tracer.tick(label, m.device.used) if scheduled else m.tracer.now
        chunks = _unique(m.slot_of[p][0] for p in params)
        protect = {(c.index, Kind.PARAM) for c in chunks}
        for chunk in chunks:
            # Decided per group, never per chunk: the rank that owns this chunk must join the
            # all-gather that the other ranks need for it.
            members = m.zero.members(m, chunk.index)
            if any(Kind.PARAM not in c.tier for c in members if c.owner != m.rank):
                m.zero.gather(m, chunk.index, protect)
            m.place(chunk, Kind.PARAM, DEVICE, protect)
            m.wait(chunk, Kind.PARAM)  # a prefetch may still be copying it (CUDA)
            m.tracer.access((chunk.index, Kind.PARAM))
        for p in params:
            m.set_state_of(p, S.COMPUTE)
        for chunk in chunks:
            m.set_views(chunk)
        m.device.note_peak()
        m.tracer.note_chunk_bytes(m.device.used)
        m.tracer.note_accounted(m.device.used, m.device.nonmodel)
        if scheduled:
            m.policy.prefetch(m, moment)

    def done_forward(self, params: list, grad: bool) -> None:
        m = self.m
        for p in params:
            m.set_state_of(p, S.HOLD_AFTER_FWD if grad else S.HOLD)
        if m.world == 1:
            return
        for p in params:
            self.fwd_done.setdefault(m.slot_of[p][0].index // m.world, set()).add(id(p))
        for group in sorted({m.slot_of[p][0].index // m.world for p in params}):
            members = m.zero.members(m, group * m.world)
            if any(c.in_compute() for c in members):
                continue
            n_slots = sum(len(c.slots) for c in members)
            if not grad or len(self.fwd_done.get(group, ())) == n_slots:
                m.zero.release(m, group * m.world, (Kind.PARAM,))

    # ------------------------------------------------------------------------ backward
    def pre_backward(self, name: str, params: list) -> None:
        self.use(params, f"bwd {name}", scheduled=True)

    def _grad_ready(self, param: nn.Parameter) -> None:
        m = self.m
        chunk, slot = m.slot_of[param]
        grad, param.grad = local_grad(param.grad), None
        buf = self._grad_buffer(chunk)
        with torch.no_grad():
            buf[slot.offset: slot.end].add_(grad.reshape(-1).to(buf.device, buf.dtype))
        if chunk.tier[Kind.GRAD] != DEVICE:
            m.transfers.add(DEVICE, HOST, grad.numel() * grad.element_size())
        m.tracer.access((chunk.index, Kind.GRAD))
        m.set_state_of(param, S.HOLD_AFTER_BWD)
        group = chunk.index // m.world
        self.pending.add(group)
        arrived = self.arrived.setdefault(group, set())
        arrived.add(id(param))
        members = m.zero.members(m, chunk.index)
        # A member still in use (a pipeline piece's backward not done with it) keeps the group:
        # compute states are the same on every rank, so all ranks decide alike.
        if (len(arrived) == sum(len(c.slots) for c in members)
                and not any(c.in_compute() for c in members)):
            arrived.clear()
            self._finish_group(group)

    def _grad_buffer(self, chunk: Chunk) -> torch.Tensor:
        m = self.m
        protect = {(chunk.index, Kind.PARAM)}
        if chunk.tier.get(Kind.GRAD) is None:
            return m.alloc(chunk, Kind.GRAD, m.grad_home(chunk), protect)
        tier = chunk.tier[Kind.GRAD]
        return m.place(chunk, Kind.GRAD, HOST if tier not in (DEVICE, HOST) else tier, protect)

    def _finish_group(self, group: int) -> None:
        m = self.m
        if m.world > 1:
            m.zero.release(m, group * m.world, (Kind.PARAM,))
        if m.sync:
            self.reduce(group)

    def reduce(self, group: int) -> None:
        if self.m.world > 1:
            self.m.zero.reduce_scatter(self.m, group * self.m.world)
        self.pending.discard(group)

    def flush(self) -> None:
        """Reduce every group still holding local gradients (before clipping or the step)."""
        m = self.m
        for group in sorted(self.pending):
            if m.world > 1:
                members = m.zero.members(m, group * m.world)
                if any(Kind.PARAM in c.payload for c in members if c.owner != m.rank):
                    m.zero.release(m, group * m.world, (Kind.PARAM,))
            self.reduce(group)
        self.arrived.clear()

    def reset(self) -> None:
        """Forget per-iteration bookkeeping (after the optimizer step)."""
        self.pending.clear()
        self.arrived.clear()
        self.fwd_done.clear()
        self.phase = "fwd"

    # ------------------------------------------------------------------- saved tensors
    def _enter_saved(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and self._saved_ctx is None:
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()

    def _exit_saved(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._saved_ctx is not None:
            ctx, self._saved_ctx = self._saved_ctx, None
            ctx.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> Any:
        found = self.m.locate(tensor)
        if found is not None:
            chunk, slot = found
            base = chunk.payload[Kind.PARAM].storage_offset() + slot.offset
            return _ChunkRef(slot.param, tensor.storage_offset() - base, tensor.size(),
                             tensor.stride())
        return _Saved(self.m, tensor)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return packed.tensor
        data = local_of(packed.param)
        if data.numel() == 0:  # released or evicted since forward: bring it back
            self.use([packed.param], "unpack", scheduled=False)
            data = local_of(packed.param)
        return data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset)


class _ChunkRef:
    """A saved view of a chunk: rebuilt from the parameter's payload when unpacked."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param, offset, size, stride) -> None:
        self.param, self.offset, self.size, self.stride = param, offset, size, stride


class _Saved:
    """A saved activation; counts as non-model memory until autograd lets go of it."""

    __slots__ = ("tensor", "manager", "ptr")

    def __init__(self, manager: ChunkManager, tensor: torch.Tensor) -> None:
        self.tensor, self.manager = tensor, manager
        storage = tensor.untyped_storage()
        self.ptr = storage.data_ptr()
        manager.tracer.grow(self.ptr, storage.nbytes())
        manager.nonmodel_changed()

    def __del__(self) -> None:
        self.manager.tracer.shrink(self.ptr)
        self.manager.device.nonmodel = self.manager.tracer.live


class _PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, the module's pre-backward hook."""

    @staticmethod
    def forward(ctx, hooks: ChunkHooks, name: str, params: list, *tensors: torch.Tensor):
        ctx.hooks, ctx.name, ctx.params = hooks, name, params
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks.pre_backward(ctx.name, ctx.params)
        return (None, None, None, *grads)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a checkpointed block's
    forward then is its recomputation). torch.utils.checkpoint relies on the same query."""
    return torch._C._current_graph_task_id() != -1


def _unique(chunks) -> list[Chunk]:
    seen: dict[int, Chunk] = {}
    for chunk in chunks:
        seen.setdefault(chunk.index, chunk)
    return list(seen.values())
