"""The chunk manager: lays parameters out in chunks and moves payloads between tiers.

It owns the chunks, the tiers, the tracer and the placement policy. The hooks (hooks.py) tell
it when a module starts or ends using its parameters and when a gradient is ready; the hybrid
Adam (hybrid_adam.py) asks it for the payloads of each chunk on the tier where the update runs;
zero.py gathers and reduce-scatters chunk groups over the data-parallel ranks.

Gradients live in chunks of their own (kind GRAD), not in the parameter chunk as in
PatrickStar: tessera trains in fp32 as well, where the parameter chunk *is* the master copy and
must survive backward, and with gradient accumulation, where the parameters are needed again by
the next micro-batch. The price is one compute-precision buffer per chunk while gradients exist;
they are freed after each optimizer step and, for chunks updated on the host, never occupy the
device (each gradient is added straight into the host buffer as it is produced).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from tessera.memory.chunk import Chunk, Kind, TensorSlot, pack, search_chunk_size
from tessera.memory.placement import make_policy
from tessera.memory.shards import local_of, point_at
from tessera.memory.tensor_state import TensorState, TransitionLog, check_transition
from tessera.memory.tiers import (DEVICE, DISK, HOST, DiskTier, MemoryBudgetError, Tier,
                                  TransferStats)
from tessera.memory.tracer import MemoryTracer
from tessera.memory.zero import ZeroGroups

S = TensorState


@dataclass(frozen=True)
class MemoryOptions:
    """How chunk memory is placed (the ``memory:`` section of a run config).

    Attributes:
        placement: "auto" (PatrickStar: traced, dynamic) or "static" (ZeRO-Offload-like).
        device_budget: bytes the compute device may use for chunks plus non-model data
            (None: no cap; on CUDA the device's own limit applies).
        host_budget: bytes of chunk payload allowed in host memory (None: no cap); beyond it
            payloads go to disk (needs offload=disk and ``disk_dir``).
        disk_dir: directory for the disk tier.
        chunk_size: elements per chunk (None: the size search picks it).
    """

    placement: str = "auto"
    device_budget: int | None = None
    host_budget: int | None = None
    disk_dir: str | None = None
    chunk_size: int | None = None


class ChunkManager:
    """Chunks of one model on one rank (see the module docstring).

    Args:
        model: the single-device model; its parameters become views into chunks.
        options: placement policy, budgets, disk directory, chunk size.
        device: the compute device.
        compute_dtype: dtype of parameter and gradient chunks (fp32, bf16 or fp16).
        offload: tiers allowed besides the device: "cpu" (host) and/or "disk".
        dp_group: process group of the data-parallel ranks the chunks are sharded over.
        param_order: the order parameters are packed in (default: registration order); a
            pipeline stage packs them in the order its graph reads them.

    Raises:
        MemoryBudgetError: when the device budget cannot hold one group of parameter and
            gradient chunks (or, for ``static``, all parameter chunks), naming the minimum.
        DiskTierError: when the disk directory is missing, read-only or too small.
    """

    def __init__(self, model: nn.Module, options: MemoryOptions, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32, offload: tuple[str, ...] = ("cpu",),
                 dp_group: dist.ProcessGroup | None = None,
                 param_order: list[nn.Parameter] | None = None) -> None:
        self.model, self.options, self.dtype = model, options, compute_dtype
        self.param_order = param_order
        self.itemsize = torch.empty((), dtype=compute_dtype).element_size()
        self.zero = ZeroGroups(dp_group)
        self.rank, self.world = self.zero.rank, self.zero.size
        self.policy = make_policy(options.placement)
        self.device = Tier(DEVICE, device, options.device_budget)
        self.host = (Tier(HOST, torch.device("cpu"), options.host_budget,
                          pin=device.type == "cuda") if "cpu" in offload else None)
        self.tracer, self.transfers, self.log = MemoryTracer(device), TransferStats(), TransitionLog()
        self.sync = True  # False inside no_sync(): keep gradients local (accumulation)
        self.adam_tier: dict[int, str] = {}
        self.evictions: dict[str, int] = {}  # tier -> payloads evicted from it
        self.chunks: list[Chunk] = []
        self.slot_of: dict[nn.Parameter, tuple[Chunk, TensorSlot]] = {}
        self._storage: dict[int, Chunk] = {}  # data_ptr of a PARAM payload -> its chunk
        self._stream = None  # CUDA side stream for prefetches, made on first use
        self._inflight: dict[tuple[int, Kind], tuple] = {}  # prefetches not yet waited on
        self._build(options.chunk_size)
        self._check_minimum()
        self.disk = None
        if "disk" in offload:
            self.disk = DiskTier(options.disk_dir or "", need_bytes=self.model_data_bytes())
        self._init_payloads()

    # ------------------------------------------------------------------------ layout
    def _build(self, chunk_size: int | None) -> None:
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.param_order is not None:
            rank = {id(p): i for i, p in enumerate(self.param_order)}
            params.sort(key=lambda item: rank.get(id(item[1]), len(rank)))
        numels = [local_of(p).numel() for _, p in params]  # tp: the local shard's size
        # Adam momentum and variance (+ an fp32 master below fp32), in compute elements.
        states = (8 + (4 if self.dtype != torch.float32 else 0)) / self.itemsize
        cap = chunk_size or search_chunk_size(numels, self.world, self._max_capacity(),
                                              state_per_element=states)
        self.capacity = cap
        packed = pack(numels, cap, 1 if chunk_size else 256)
        packed += [(cap, [])] * ((-len(packed)) % self.world)  # ZeRO padding chunks
        for g in range(0, len(packed), self.world):  # a group's chunks gather as one
            width = max(c for c, _ in packed[g: g + self.world])
            for i in range(g, g + self.world):
                chunk = Chunk(i, width, owner=i % self.world)
                offset = 0
                for t in packed[i][1]:
                    name, p = params[t]
                    shard = local_of(p)
                    slot = TensorSlot(name, p, offset, shard.numel(), shard.shape,
                                      0 if p.dim() >= 2 else 1)
                    chunk.slots.append(slot)
                    self.slot_of[p] = (chunk, slot)
                    offset += shard.numel()
                self.chunks.append(chunk)

    def _max_capacity(self) -> int | None:
        # Keep one group of parameter and gradient chunks within half the device budget.
        if self.device.budget is None:
            return None
        return self.device.budget // (2 * self.world * 2 * self.itemsize)

    def _check_minimum(self) -> None:
        budget = self.device.budget
        if budget is None:
            return
        largest = max(c.capacity for c in self.chunks) * self.itemsize
        need = 2 * self.world * largest  # a gathered group of parameters plus its gradients
        if self.policy.pins_params:
            need = self.param_bytes_resident() + self.gather_bytes() + largest
        if budget < need:
            raise MemoryBudgetError(
                f"memory.device_budget={budget} bytes is too small for placement="
                f"{self.policy.name}: it needs at least {need} bytes of chunks (chunk size "
                f"{self.capacity} elements x {self.itemsize} B, dp={self.world}) plus the peak "
                f"non-model memory")
        if self.host is None and budget < self.model_data_bytes():
            raise MemoryBudgetError(
                f"memory.device_budget={budget} bytes cannot hold the model data "
                f"({self.model_data_bytes()} bytes) and offload has no 'cpu' tier to evict to")

    def _init_payloads(self) -> None:
        for chunk in self.chunks:
            if chunk.owner != self.rank:
                for slot in chunk.slots:
                    self._set_state(slot, S.FREE)
                self.set_views(chunk)
                continue
            if self.dtype != torch.float32:  # keep fp32 values before they are rounded
                master = self.alloc(chunk, Kind.MASTER, self._home(), set(), torch.float32)
                self._copy_in(chunk, master)
            payload = self.alloc(chunk, Kind.PARAM, self._initial_tier(chunk), set())
            self._copy_in(chunk, payload)
            self.set_views(chunk)

    def _initial_tier(self, chunk: Chunk) -> str:
        """Parameters start on the device while it has room for them and their gradients
        (always under static, which pins them); the rest start on the host."""
        roomy = self.device.room(0) > 2 * chunk.capacity * self.itemsize
        return DEVICE if self.policy.pins_params or roomy or self.host is None else HOST

    def _copy_in(self, chunk: Chunk, payload: torch.Tensor) -> None:
        with torch.no_grad():
            for slot in chunk.slots:
                payload[slot.offset: slot.end].copy_(local_of(slot.param).reshape(-1))

    # ------------------------------------------------------------------ sizes and views
    def own_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.owner == self.rank]

    def param_bytes_resident(self) -> int:
        return sum(c.capacity for c in self.own_chunks()) * self.itemsize

    def gather_bytes(self) -> int:
        """Device bytes for the remote chunks of one gathered group (0 without ZeRO)."""
        largest = max(c.capacity for c in self.chunks)
        return (self.world - 1) * largest * self.itemsize * 2 if self.world > 1 else 0

    def model_data_bytes(self) -> int:
        """Parameters, gradients, fp32 masters and Adam states of this rank's chunks."""
        per_element = 2 * self.itemsize + 8 + 4  # param + grad + m + v + master
        return sum(c.capacity for c in self.own_chunks()) * per_element

    def device_adam_bytes_per_element(self) -> int:
        """Device bytes per element a chunk adds when its Adam runs on the device."""
        master = 4 if self.dtype != torch.float32 else 0
        return self.itemsize + 8 + master  # gradient + momentum + variance (+ master)

    def _home(self) -> str:
        return HOST if self.host is not None else DEVICE

    def grad_home(self, chunk: Chunk) -> str:
        """Where a chunk's gradients accumulate: the device for remote chunks (until the
        reduce-scatter), else the tier its Adam runs on (the host during a budgeted warm-up)."""
        if chunk.owner != self.rank:
            return DEVICE
        # Warm-up: without a device budget there is no reason to send gradients away.
        warm_up = DEVICE if self.device.budget is None else self._home()
        return self.adam_tier.get(chunk.index, warm_up)

    def tier_of(self, name: str) -> Tier:
        return self.device if name == DEVICE else self.host

    def set_views(self, chunk: Chunk) -> None:
        """Point each parameter of ``chunk`` at its slot of the device payload, or at an empty
        placeholder where the payload is elsewhere or the tensor is FREE."""
        payload = chunk.payload.get(Kind.PARAM)
        on_device = payload is not None and chunk.tier[Kind.PARAM] == DEVICE
        base = payload.data_ptr() if on_device else 0
        size = payload.element_size() if on_device else 0
        for slot in chunk.slots:
            # Every hook re-asserts the views of its chunks: skip those already in place (a
            # live view's address is unique: its storage cannot be reused while it exists).
            current = local_of(slot.param)
            if on_device and slot.state is not S.FREE:
                if (current.data_ptr() == base + slot.offset * size
                        and current.shape == slot.shape and current.dtype == payload.dtype
                        and current.is_contiguous()):
                    continue
                point_at(slot.param, payload[slot.offset: slot.end].view(slot.shape))
            elif current.numel() or current.dtype != self.dtype:
                # an empty placeholder makes any use outside the hooks fail loudly
                point_at(slot.param, torch.empty(0, dtype=self.dtype, device=self.device.device))

    def _set_state(self, slot: TensorSlot, new: S) -> None:
        check_transition(slot.name, slot.state, new)
        self.log.record(slot.state, new)
        slot.state = new

    def set_state_of(self, param: nn.Parameter, new: S) -> None:
        self._set_state(self.slot_of[param][1], new)

    def set_states(self, chunk: Chunk, new: S, only: tuple[S, ...] | None = None) -> None:
        for slot in chunk.slots:
            if only is None or slot.state in only:
                self._set_state(slot, new)

    # ------------------------------------------------------------------ payload movement
    def alloc(self, chunk: Chunk, kind: Kind, tier: str, protect: set,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new zeroed payload of ``kind`` for ``chunk`` on ``tier``, making room first."""
        dtype = dtype or (self.dtype if kind in (Kind.PARAM, Kind.GRAD) else torch.float32)
        nbytes = chunk.capacity * torch.empty((), dtype=dtype).element_size()
        self._make_room(tier, nbytes, protect | {(chunk.index, kind)})
        payload = self.tier_of(tier).allocate(chunk.capacity, dtype)
        chunk.payload[kind], chunk.tier[kind] = payload, tier
        if kind is Kind.PARAM:
            self._storage[payload.untyped_storage().data_ptr()] = chunk
        return payload

    def drop(self, chunk: Chunk, kind: Kind) -> None:
        """Release a payload (its data is no longer needed here)."""
        self.wait(chunk, kind)
        payload = chunk.payload.pop(kind, None)
        tier = chunk.tier.pop(kind, None)
        if payload is None:
            if tier == DISK and self.disk is not None:
                self.disk.read(self._key(chunk, kind))
            return
        self.tier_of(tier).free(payload)
        if kind is Kind.PARAM:
            self._storage.pop(payload.untyped_storage().data_ptr(), None)
            self.set_views(chunk)

    def place(self, chunk: Chunk, kind: Kind, dest: str, protect: set,
              prefetch: bool = False) -> torch.Tensor | None:
        """Move the payload of ``(chunk, kind)`` to tier ``dest``; returns it (None on disk).

        A payload returned for use (``prefetch`` False) is complete on the current stream:
        one already at ``dest`` may still be arriving there from an earlier prefetch (a side
        stream on CUDA), and a collective or an optimizer reading it at once would see the
        buffer half copied."""
        src = chunk.tier.get(kind)
        if src == dest:
            if not prefetch:
                self.wait(chunk, kind)
            return chunk.payload.get(kind)
        if src is None:
            raise RuntimeError(f"chunk {chunk.index} {kind.value} has no payload to move")
        self.wait(chunk, kind)  # never move a buffer a prefetch is still writing
        if src == DISK:  # read back through host memory
            data = self.disk.read(self._key(chunk, kind))
            self.transfers.add(DISK, HOST, data.numel() * data.element_size())
        else:
            data = chunk.payload[kind]
        if dest == DISK:
            self.disk.write(self._key(chunk, kind), data)
            self._count(src, HOST, data)
            self.transfers.add(HOST, DISK, data.numel() * data.element_size())
            self._forget(chunk, kind, src, data)
            chunk.tier[kind] = DISK
            return None
        protect = protect | {(chunk.index, kind)}
        self._make_room(dest, data.numel() * data.element_size(), protect)
        new = self.tier_of(dest).allocate(data.numel(), data.dtype)
        if prefetch and new.is_cuda:
            self._copy_async(chunk, kind, new, data)
        else:
            new.copy_(data)
        self._count(HOST if src == DISK else src, dest, data)
        self._forget(chunk, kind, src, data)
        chunk.payload[kind], chunk.tier[kind] = new, dest
        if kind is Kind.PARAM:
            self._storage[new.untyped_storage().data_ptr()] = chunk
            self.set_views(chunk)
        return new

    def _copy_async(self, chunk: Chunk, kind: Kind, new: torch.Tensor,
                    data: torch.Tensor) -> None:
        """Prefetch on a side stream so the copy overlaps compute; :meth:`wait` joins it."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=new.device)
        self._stream.wait_stream(torch.cuda.current_stream(new.device))  # `new` is allocated
        with torch.cuda.stream(self._stream):
            new.copy_(data, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # Keep the source alive until the copy has finished.
        self._inflight[(chunk.index, kind)] = (event, data)

    def wait(self, chunk: Chunk, kind: Kind) -> None:
        """Make the current stream wait for a prefetch of ``(chunk, kind)``, if one is running."""
        pending = self._inflight.pop((chunk.index, kind), None)
        if pending is not None:
            torch.cuda.current_stream(self.device.device).wait_event(pending[0])

    def _forget(self, chunk: Chunk, kind: Kind, src: str, data: torch.Tensor) -> None:
        """Drop the old payload after a move (its bytes leave the source tier's account)."""
        chunk.payload.pop(kind, None)
        if src in (DEVICE, HOST):
            self.tier_of(src).free(data)
        if kind is Kind.PARAM:
            self._storage.pop(data.untyped_storage().data_ptr(), None)
            self.set_views(chunk)

    def _count(self, src: str, dest: str, data: torch.Tensor) -> None:
        if src != dest:
            self.transfers.add(src, dest, data.numel() * data.element_size())

    def _key(self, chunk: Chunk, kind: Kind) -> str:
        # The global rank: ranks of different pipeline stages (or tp shards) share a ZeRO
        # rank and may share disk_dir, and their chunk files must not collide.
        rank = dist.get_rank() if dist.is_initialized() else self.rank
        return f"rank{rank}_chunk{chunk.index}_{kind.value}"

    def _make_room(self, tier: str, nbytes: int, protect: set) -> None:
        if tier == DEVICE:
            reserve = self.tracer.reserve(self.tracer.now) if self.tracer.warm else 0
            while self.device.room(reserve) < nbytes:
                if not self._evict_one(DEVICE, protect):
                    raise self._too_small(nbytes, reserve, protect)
        elif tier == HOST and self.host is not None and self.host.budget is not None:
            while self.host.room() < nbytes:
                if self.disk is None or not self._evict_one(HOST, protect):
                    raise self._host_full(nbytes, protect)

    def _evict_one(self, tier: str, protect: set) -> bool:
        candidates = [(c, k) for c in self.chunks for k, t in list(c.tier.items())
                      if t == tier and (c.index, k) not in protect and self._evictable(c, k)]
        choice = self.policy.victim(self, candidates, self.tracer.now)
        if choice is None:
            return False
        chunk, kind = choice
        if tier == DEVICE and self.host is None:
            return False
        self.place(chunk, kind, HOST if tier == DEVICE else DISK, protect)
        self.evictions[tier] = self.evictions.get(tier, 0) + 1
        self.tracer.note_eviction()
        return True

    def _evictable(self, chunk: Chunk, kind: Kind) -> bool:
        if chunk.owner != self.rank:
            return False  # remote payloads leave only by release, at the same point everywhere
        if kind is Kind.PARAM:
            return not chunk.in_compute() and not self.policy.pins_params
        if kind is Kind.GRAD:
            return not chunk.in_compute()
        return True

    def _evictable_bytes(self, tier: str, protect: set) -> int:
        """Payload bytes on ``tier`` that could leave it now (not in use, pinned or remote)."""
        return sum(c.payload[k].numel() * c.payload[k].element_size() for c in self.chunks
                   for k, t in c.tier.items()
                   if t == tier and (c.index, k) not in protect and self._evictable(c, k))

    def _too_small(self, nbytes: int, reserve: int, protect: set = frozenset()
                   ) -> MemoryBudgetError:
        # Payloads that cannot leave the device now: in use (protected by the caller, e.g.
        # a pipeline piece's chunks), pinned (static) or remote.
        in_use = self.device.used - self._evictable_bytes(DEVICE, protect)
        nonmodel = max(reserve, self.device.nonmodel)
        need = in_use + nbytes + nonmodel
        return MemoryBudgetError(
            f"memory.device_budget={self.device.budget} bytes is too small: this step needs at "
            f"least {need} bytes on the device ({in_use + nbytes} of chunks in use, {nonmodel} "
            f"non-model); raise the budget to at least {need} or lower the micro-batch size")

    def _host_full(self, nbytes: int, protect: set) -> MemoryBudgetError:
        budget = f"memory.host_budget={self.host.budget} bytes is full"
        if self.disk is None:
            return MemoryBudgetError(
                f"{budget} ({self.host.used} used, {nbytes} more needed) and there is no disk "
                "tier to spill to (offload=cpu+disk with memory.disk_dir)")
        # With a disk tier: what is left on the host is in use now (being computed or
        # reduced, or another rank's), so nothing more can spill.
        in_use = self.host.used - self._evictable_bytes(HOST, protect)
        need = in_use + nbytes
        return MemoryBudgetError(
            f"{budget}: its {in_use} bytes of chunks in use now cannot spill to disk and "
            f"{nbytes} more are needed; raise it to at least {need}")

    # ------------------------------------------------------------------ non-model memory
    def nonmodel_changed(self) -> None:
        """The tracer's live non-model bytes changed: keep accounted bytes within budget."""
        live = self.tracer.nonmodel(self.device.used)
        budget = self.device.budget
        if budget is not None:
            while self.device.used + live > budget:
                if not self._evict_one(DEVICE, set()):
                    raise self._too_small(0, live)
        self.device.nonmodel = live
        self.device.note_peak()
        self.tracer.note_accounted(self.device.used, live)

    # ------------------------------------------------------------------ accumulation flag
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep gradients on each rank (no reduce-scatter) for all but the last micro-batch."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def locate(self, tensor: torch.Tensor) -> tuple[Chunk, TensorSlot] | None:
        """The chunk slot whose payload ``tensor`` views, or None (non-model data)."""
        chunk = self._storage.get(tensor.untyped_storage().data_ptr())
        if chunk is None:
            return None
        offset = tensor.storage_offset() - chunk.payload[Kind.PARAM].storage_offset()
        for slot in chunk.slots:
            if slot.offset <= offset < max(slot.end, slot.offset + 1):
                return chunk, slot
        return None
