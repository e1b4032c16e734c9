"""ZeRO over chunks: groups of ``dp`` consecutive chunks, one owned by each rank.

Chunk ``i`` belongs to group ``i // dp`` and is owned by rank ``i % dp``. The owner alone keeps
its parameters between iterations and its masters and Adam states at all times, and updates it.
Before a group is used, every rank all-gathers it (the owner sends its chunk); once every tensor
of the group is done with (after forward, and again after backward) the remote payloads are
released. After backward the group's gradient chunks are reduce-scattered, so each owner gets
the mean gradient of its chunk. Every rank runs the same hooks in the same order, so gathers and
reduce-scatters line up without extra coordination; the release points depend only on tensor
states, never on memory pressure, for the same reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tessera.distributed import reduce_scatter_flat
from tessera.memory.chunk import Chunk, Kind
from tessera.memory.tensor_state import TensorState
from tessera.memory.tiers import DEVICE, DISK, HOST

if TYPE_CHECKING:
    from tessera.memory.manager import ChunkManager

S = TensorState


class ZeroGroups:
    """Group arithmetic and the collectives over one data-parallel process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        live = group is not None and dist.is_initialized()
        self.rank = dist.get_rank(group) if live else 0
        self.size = dist.get_world_size(group) if live else 1

    def members(self, manager: "ChunkManager", index: int) -> list[Chunk]:
        start = index // self.size * self.size
        return manager.chunks[start: start + self.size]

    def gather(self, manager: "ChunkManager", index: int, protect: set) -> None:
        """All-gather the parameter chunks of ``index``'s group onto the device."""
        members = self.members(manager, index)
        protect = protect | {(c.index, Kind.PARAM) for c in members}
        own = members[self.rank]
        manager.place(own, Kind.PARAM, DEVICE, protect)
        for chunk in members:
            if chunk is not own and Kind.PARAM not in chunk.payload:
                manager.alloc(chunk, Kind.PARAM, DEVICE, protect)
        dist.all_gather([c.payload[Kind.PARAM] for c in members], own.payload[Kind.PARAM],
                        group=self.group)
        for chunk in members:
            if chunk is not own:
                manager.set_states(chunk, S.HOLD, only=(S.FREE,))
                manager.set_views(chunk)

    def release(self, manager: "ChunkManager", index: int, kinds: tuple[Kind, ...]) -> None:
        """Drop the remote payloads of ``kinds`` in ``index``'s group (their tensors: FREE)."""
        for chunk in self.members(manager, index):
            if chunk.owner == self.rank:
                continue
            if Kind.PARAM in kinds:
                manager.set_states(chunk, S.FREE)
            for kind in kinds:
                manager.drop(chunk, kind)

    def reduce_scatter(self, manager: "ChunkManager", index: int) -> None:
        """Average the group's gradient chunks over ranks into each owner's chunk."""
        members = self.members(manager, index)
        own = members[self.rank]
        protect = {(c.index, Kind.GRAD) for c in members}
        # One flat (size, capacity) input (see reduce_scatter_flat for why); NCCL made the
        # same copy inside its list form. Members of a group share one capacity, as the
        # all-gather needs.
        flat = torch.empty(len(members), own.capacity, dtype=manager.dtype,
                           device=manager.device.device)
        for row, chunk in zip(flat, members):
            if chunk.tier.get(Kind.GRAD) == DISK:  # own chunk, evicted since its last gradient
                manager.place(chunk, Kind.GRAD, HOST, protect)
            grad = chunk.payload.get(Kind.GRAD)
            if grad is None:  # a padding chunk, or no gradient arrived here
                row.zero_()
            else:
                row.copy_(grad)
        # fp16: divide before summing, as DDP's default hook does. Loss-scaled fp16 gradients
        # sit close to fp16's largest value (65504), so the sum of dp of them can overflow
        # where their mean does not, and the step would be skipped at the dp=1 run's scale.
        divide_first = manager.dtype == torch.float16
        if divide_first:
            flat.div_(self.size)
        if self.size == 1:
            out = flat[0]
        else:
            out = torch.empty(own.capacity, dtype=manager.dtype, device=manager.device.device)
            reduce_scatter_flat(out, flat, self.group)
        if not divide_first:
            out.div_(self.size)
        target = own.payload.get(Kind.GRAD)
        if target is None:
            target = manager.alloc(own, Kind.GRAD, manager.grad_home(own), set())
        target.copy_(out)
        self.release(manager, index, (Kind.GRAD,))
