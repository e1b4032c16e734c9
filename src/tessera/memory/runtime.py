"""The chunk runtime of one model: manager + hooks, and what the Trainer calls on them.

``apply_chunk_memory`` is the memory step of :func:`tessera.parallel.parallelize`. The runtime
it returns gives the plan its optimizer factory (HybridAdam), gradient clipping over gradient
chunks, the fp16 loss scaler, and state-dict hooks so that ``model.state_dict()`` and
``load_state_dict`` (and with them torch.distributed.checkpoint) see full fp32 tensors although
the parameters live in chunks, possibly on another tier or on another rank.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.memory.chunk import Chunk, Kind
from tessera.memory.hooks import ChunkHooks
from tessera.memory.hybrid_adam import HybridAdam
from tessera.memory.manager import ChunkManager, MemoryOptions
from tessera.memory.scaler import ChunkLossScaler
from tessera.memory.shard_state import ShardStateDicts
from tessera.memory.shards import has_shards, local_of
from tessera.memory.tensor_state import TensorState
from tessera.memory.tiers import DEVICE, DISK, HOST
from tessera.parallel.tensor.loss import replica_count

S = TensorState
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def as_options(memory: Any) -> MemoryOptions:
    """MemoryOptions from None, a MemoryOptions, or anything with the same attributes
    (the config's ``memory:`` section)."""
    if memory is None:
        return MemoryOptions()
    if isinstance(memory, MemoryOptions):
        return memory
    return MemoryOptions(**{f.name: getattr(memory, f.name)
                            for f in dataclasses.fields(MemoryOptions)})


def apply_chunk_memory(model: nn.Module, strategy, mesh, memory: Any = None) -> "ChunkRuntime":
    """Put ``model``'s parameters into chunks managed under ``strategy`` (memory=chunk)."""
    options = as_options(memory)
    if options.placement == "static" and "cpu" not in strategy.offload:
        raise ValueError("memory.placement=static keeps gradients and optimizer states on the "
                         "host: it needs offload=cpu in the strategy")
    device = local_of(next(model.parameters())).device
    return ChunkRuntime(model, options, device, _DTYPES[strategy.precision], strategy.offload,
                        _zero_group(strategy, mesh),
                        mesh.group("tp") if strategy.tp > 1 else None)


def _zero_group(strategy, mesh):
    """The ranks chunks are ZeRO-sharded over: those holding the same weights.

    Under sequence parallelism the sp ranks of a dp rank hold the same weights and each
    computes gradients from its own tokens, so sharding over dp x sp makes the
    reduce-scatter average them over dp x sp, as DDP over dp x sp does without chunks.
    Under tensor parallelism each tp rank has its own chunks (of its own shards).
    """
    if strategy.sp > 1:
        return mesh.flat_group("dp", "sp")
    return mesh.group("dp") if mesh.size("dp") > 1 else None


class ChunkRuntime:
    """Manager, hooks, optimizer factory, clipping, scaler and state-dict hooks of a model."""

    def __init__(self, model: nn.Module, options: MemoryOptions, device: torch.device,
                 compute_dtype: torch.dtype, offload: tuple[str, ...],
                 dp_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup | None = None,
                 param_order: list[nn.Parameter] | None = None) -> None:
        self.model, self.tp_group = model, tp_group
        self.manager = ChunkManager(model, options, device, compute_dtype, offload, dp_group,
                                    param_order)
        self.hooks = ChunkHooks(self.manager, model)
        self.scaler = ChunkLossScaler(self) if compute_dtype == torch.float16 else None
        self.names: dict[nn.Parameter, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in self.manager.slot_of:
                self.names.setdefault(p, []).append(name)
        self._loaded: set[str] = set()
        if has_shards(model):  # tp: the DTensor wrappers and tp hooks do the layout
            ShardStateDicts(self).register(model)
            return
        # torch tags public hooks with an attribute, which bound methods refuse: use partials.
        model.register_state_dict_post_hook(functools.partial(ChunkRuntime._state_dict_hook, self))
        model.register_load_state_dict_pre_hook(functools.partial(ChunkRuntime._load_pre_hook,
                                                                  self))
        model.register_load_state_dict_post_hook(
            functools.partial(ChunkRuntime._load_post_hook, self))

    # ------------------------------------------------------------------ for the Trainer
    def attach(self, plan: Any) -> None:
        """Give a :class:`~tessera.parallel.plan.Parallelized` this runtime's pieces."""
        plan.build_optimizer, plan.clip_grad_norm = self.build_optimizer, self.clip_grad_norm
        plan.grad_scaler, plan.memory = self.scaler, self
        plan.features.append("chunk_memory")
        # The Engine keeps gradients local for all but the last micro-batch via no_sync().
        self.model.no_sync = self.manager.no_sync

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float,
                        betas: tuple[float, float], eps: float, device: torch.device
                        ) -> HybridAdam:
        """Same signature as :func:`tessera.train.optim.build_optimizer`."""
        optimizer = HybridAdam(self, model, lr, weight_decay, betas, eps)
        if has_shards(model):  # fused q|k|v shards: moments saved unpermuted, as without chunks
            from tessera.parallel.tensor.shard import add_optimizer_unpermute_hooks

            add_optimizer_unpermute_hooks(optimizer, model)
        return optimizer

    @torch.no_grad()
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradient chunks to a total 2-norm of ``max_norm``; returns the norm."""
        self.hooks.flush()
        owned = [c for c in self.manager.own_chunks() if Kind.GRAD in c.tier]
        return self.scale_to_norm(self.squared_grad_sum(owned), owned, max_norm, self.tp_group)

    @torch.no_grad()
    def squared_grad_sum(self, owned: list, skip: set[int] | None = None) -> torch.Tensor:
        """This rank's sum of squared gradients over the ``owned`` chunks, a piece held by
        several tp ranks counted once; with ``skip`` (parameter ids) slot by slot, leaving
        those out. Not yet reduced over any group."""
        total = torch.zeros((), dtype=torch.float32, device=self.manager.device.device)
        tp = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        # One chunk at a time, using each payload before reading the next: reading a chunk
        # back from disk may evict another's gradient, and a tensor kept from before that
        # eviction is a stale copy (scaling it would be lost).
        for chunk in owned:
            g = self.readable(chunk, Kind.GRAD)
            if self.tp_group is None and skip is None:
                total += g.float().pow(2).sum().to(total.device)
                continue
            for slot in chunk.slots:
                if skip is not None and id(slot.param) in skip:
                    continue
                piece = g[slot.offset: slot.end].float().pow(2).sum()
                total += (piece / replica_count(slot.param, tp)).to(total.device)
        return total

    @torch.no_grad()
    def scale_to_norm(self, total: torch.Tensor, owned: list, max_norm: float,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
        """Sum the squared partial ``total`` over the dp owners and ``group`` (tp, or pp
        under a pipeline), then scale the ``owned`` gradient chunks to ``max_norm``; returns
        the norm before scaling."""
        if self.manager.world > 1:
            dist.all_reduce(total, group=self.manager.zero.group)
        if group is not None:
            dist.all_reduce(total, group=group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for chunk in owned:
            g = self.readable(chunk, Kind.GRAD)
            g.mul_(coef.to(g.device))
        return norm

    def end_iteration(self) -> None:
        """After the step: tensors back to HOLD (own) or FREE (remote), gradients dropped."""
        m = self.manager
        for chunk in m.chunks:
            own = chunk.owner == m.rank
            for slot in chunk.slots:
                if slot.state in (S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD):
                    m._set_state(slot, S.HOLD if own else S.FREE)
            if not own and Kind.PARAM in chunk.payload and all(
                    s is S.FREE for s in chunk.states()):
                m.drop(chunk, Kind.PARAM)
        self.drop_grads()
        m.tracer.end_iteration()

    def drop_grads(self) -> None:
        for chunk in self.manager.chunks:
            self.manager.drop(chunk, Kind.GRAD)
        self.hooks.reset()

    def readable(self, chunk: Chunk, kind: Kind) -> torch.Tensor | None:
        """The payload of ``(chunk, kind)`` in memory (read back from disk if needed)."""
        tier = chunk.tier.get(kind)
        if tier is None:
            return None
        if tier == DISK:
            return self.manager.place(chunk, kind, HOST, set())
        self.manager.wait(chunk, kind)  # a prefetch may still be writing it (CUDA)
        return chunk.payload[kind]

    # ------------------------------------------------------------- full tensors, all ranks
    def _chunk_values(self, chunk: Chunk, kinds: tuple[Kind, ...]) -> torch.Tensor | None:
        """The first of ``kinds`` the owner holds, as fp32, on every rank (broadcast)."""
        m = self.manager
        value = None
        if chunk.owner == m.rank:
            for kind in kinds:
                payload = self.readable(chunk, kind)
                if payload is not None:
                    value = payload.float()
                    break
        if m.world == 1:
            return None if value is None else value.cpu()
        flag = torch.tensor([0.0 if value is None else 1.0], device=m.device.device)
        src = dist.get_global_rank(m.zero.group, chunk.owner)
        dist.broadcast(flag, src=src, group=m.zero.group)
        if flag.item() == 0.0:
            return None
        buf = (value.to(m.device.device) if value is not None
               else torch.empty(chunk.capacity, device=m.device.device))
        dist.broadcast(buf, src=src, group=m.zero.group)
        return buf.cpu()

    def _per_param(self, kinds: tuple[Kind, ...]) -> dict[nn.Parameter, torch.Tensor | None]:
        out: dict[nn.Parameter, torch.Tensor | None] = {}
        for chunk in self.manager.chunks:
            values = self._chunk_values(chunk, kinds)
            for slot in chunk.slots:
                out[slot.param] = (None if values is None else
                                   values[slot.offset: slot.end].view(slot.shape).clone())
        return out

    def full_params(self) -> dict[nn.Parameter, torch.Tensor]:
        return self._per_param((Kind.MASTER, Kind.PARAM))

    def full_optimizer_state(self) -> dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]]:
        momentum = self._per_param((Kind.MOMENTUM,))
        variance = self._per_param((Kind.VARIANCE,))
        zeros = {p: torch.zeros(p_shape(self.manager, p)) for p in momentum}
        return {p: (momentum[p] if momentum[p] is not None else zeros[p],
                    variance[p] if variance[p] is not None else zeros[p].clone())
                for p in momentum}

    @torch.no_grad()
    def load_optimizer_state(self, values: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]]
                             ) -> None:
        m = self.manager
        for chunk in m.own_chunks():
            if not any(slot.param in values for slot in chunk.slots):
                continue
            tier = m.adam_tier.get(chunk.index, HOST if m.host is not None else DEVICE)
            for which, kind in enumerate((Kind.MOMENTUM, Kind.VARIANCE)):
                buf = self.readable(chunk, kind)
                if buf is None:
                    buf = m.alloc(chunk, kind, tier, set())
                for slot in chunk.slots:
                    if slot.param in values:
                        buf[slot.offset: slot.end].copy_(values[slot.param][which].reshape(-1))

    # ---------------------------------------------------------------- state-dict hooks
    def _state_dict_hook(self, module: nn.Module, state_dict: dict, prefix: str,
                         local_metadata: Any) -> None:
        for param, value in self.full_params().items():
            for name in self.names[param]:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = value

    @torch.no_grad()
    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str,
                       local_metadata: Any, strict: bool, missing: list, unexpected: list,
                       errors: list) -> None:
        m = self.manager
        for param, names in self.names.items():
            keys = [prefix + n for n in names if prefix + n in state_dict]
            if not keys:
                continue
            value = state_dict[keys[0]]
            for key in keys:
                state_dict.pop(key)
                self._loaded.add(key)
            chunk, slot = m.slot_of[param]
            if chunk.owner != m.rank:
                continue
            for kind in (Kind.PARAM, Kind.MASTER):
                buf = self.readable(chunk, kind)
                if buf is not None:
                    buf[slot.offset: slot.end].copy_(value.reshape(-1))

    def _load_post_hook(self, module: nn.Module, incompatible: Any) -> None:
        missing = incompatible.missing_keys
        missing[:] = [k for k in missing if k not in self._loaded]
        self._loaded.clear()

    def stats(self) -> dict[str, Any]:
        """Transfers, accounted peak and evictions so far (for logs and benchmarks)."""
        m = self.manager
        return {"transfers": m.transfers.snapshot(), "device_peak": m.device.peak,
                "device_budget": m.device.budget, "chunk_size": m.capacity,
                "chunks": len(m.chunks), "evictions": dict(m.evictions),
                "adam_on_device": sum(t == DEVICE for t in m.adam_tier.values())}


def p_shape(manager: ChunkManager, param: nn.Parameter) -> torch.Size:
    return manager.slot_of[param][1].shape
