"""Communication for sequence parallelism: a tiny ring object, ring passes, all-to-all.

The algorithm files (ring.py, rsa.py, ulysses.py) never call torch.distributed themselves.
Groups are passed in; nothing here is a module-level global.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

Tensors = list[torch.Tensor]
StepFn = Callable[[int, int, Tensors], Tensors]


class RingComm:
    """Send to the next rank and receive from the previous one, asynchronously.

    Usage: ``buf = comm.send_recv(t); comm.commit(); <compute>; comm.wait()``: the transfer
    runs while the caller computes on the block it already holds.

    Each tensor of a batch gets its own message tag (``tag`` + its position), so two rings on
    one group (blocks and travelling gradients) never match each other's messages.

    Args:
        group: the sequence-parallel process group (ring order = group rank order).
        tag: first message tag of this ring.
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0) -> None:
        self.group, self.tag = group, tag
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []

    def send_recv(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queue sending ``tensor`` to the next rank; returns the buffer the previous fills."""
        tensor = tensor.contiguous()
        buffer = torch.empty_like(tensor)
        tag = self.tag + len(self._ops) // 2
        self._ops.append(dist.P2POp(dist.isend, tensor, self.next, self.group, tag))
        self._ops.append(dist.P2POp(dist.irecv, buffer, self.prev, self.group, tag))
        return buffer

    def commit(self) -> None:
        """Start every queued transfer."""
        self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        """Block until the committed transfers are done (received buffers are then valid)."""
        for req in self._reqs:
            req.wait()
        self._reqs = []


def source_rank(rank: int, step: int, size: int) -> int:
    """Owner of the block a rank holds at ``step`` of a ring pass: blocks move to rank+1."""
    return (rank - step) % size


def ring_pass(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], step_fn: StepFn
              ) -> None:
    """Circulate ``tensors`` once around the ring, calling ``step_fn(step, src, held)``.

    The next block is in flight while ``step_fn`` computes on the current one.
    """
    comm, held = RingComm(group), list(tensors)
    for step in range(comm.size):
        last = step == comm.size - 1
        if not last:
            incoming = [comm.send_recv(t) for t in held]
            comm.commit()
        step_fn(step, source_rank(comm.rank, step, comm.size), held)
        if not last:
            comm.wait()
            held = incoming


def ring_pass_with_grads(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor],
                         step_fn: StepFn) -> Tensors:
    """Circulate ``tensors``; each step's gradient contributions travel with their block.

    ``step_fn(step, src, held)`` returns this rank's gradient contributions for the held
    block (owned by ``src``). A second ring carries the accumulated gradients one step behind
    the blocks; after a full turn plus one hop each block's gradient is back at its owner.

    Returns:
        the fully reduced gradients of this rank's own block, one per contribution.
    """
    blocks, grads = RingComm(group, tag=0), RingComm(group, tag=100)
    held, travelling = list(tensors), None
    for step in range(blocks.size):
        last = step == blocks.size - 1
        if not last:
            incoming = [blocks.send_recv(t) for t in held]
            blocks.commit()
        contrib = step_fn(step, source_rank(blocks.rank, step, blocks.size), held)
        if travelling is not None:
            grads.wait()
            contrib = [c + t for c, t in zip(contrib, travelling)]
        if blocks.size == 1:
            return contrib
        travelling = [grads.send_recv(c) for c in contrib]
        grads.commit()
        if not last:
            blocks.wait()
            held = incoming
    grads.wait()
    return travelling


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange equal chunks of dim 0: chunk j goes to rank j, arriving chunk i came from i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps strides
    dist.all_to_all_single(out, x, group=group)
    return out


def all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no gradient)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
