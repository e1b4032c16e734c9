"""Point-to-point messages between pipeline stages (the communication half of the pipeline).

A message is every tensor crossing one stage boundary for one micro-batch, packed into one
flat fp32 buffer: one send per boundary instead of one per tensor. Messages carry a tag made
of (micro-batch, stage, direction), so a receive posted early matches exactly its send, in
whatever order the two ranks reach them. Sends are asynchronous and waited at the end of the
step; a rank only ever blocks in :meth:`Pending.wait`, for a message the schedule guarantees
its neighbour sends without waiting on this rank first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one boundary tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def message_tag(micro_batch: int, stage: int, direction: int, n_stages: int) -> int:
    """Unique tag of the message entering ``stage`` for ``micro_batch`` in ``direction``."""
    return (micro_batch * n_stages + stage) * 2 + direction


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 buffer of all tensors (detached)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unpack(flat: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """Split a flat buffer back into tensors of ``specs``, each in its own storage when
    there are several: autograd saving a view of one would keep the whole buffer alive (a
    stage cut after a norm receives the residual and the normed hidden; the normed one is
    saved by the next projections, the residual need not outlive the forward)."""
    out, offset = [], 0
    for spec in specs:
        n = math.prod(spec.shape)
        part = flat[offset:offset + n].view(spec.shape)
        if spec.dtype != flat.dtype:
            part = part.to(spec.dtype)  # a copy already
        elif len(specs) > 1:
            part = part.clone()
        out.append(part)
        offset += n
    return out


class Pending:
    """A posted receive; :meth:`wait` returns its tensors."""

    def __init__(self, work, buffer: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.work, self.buffer, self.specs = work, buffer, specs

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        return unpack(self.buffer, self.specs)


class StageLink:
    """Sends and receives between virtual stages placed on the ranks of the pp group.

    Args:
        group: the pipeline process group (this rank's pp axis).
        stage_rank: group rank that runs each virtual stage.
        device: where receive buffers live.
    """

    def __init__(self, group: dist.ProcessGroup, stage_rank: list[int],
                 device: torch.device) -> None:
        self.group, self.stage_rank, self.device = group, stage_rank, device
        self.n_stages = len(stage_rank)
        self.sends: list = []

    def send(self, tensors: list[torch.Tensor], to_stage: int, micro_batch: int,
             direction: int) -> None:
        """Post an asynchronous send of ``tensors`` to ``to_stage``."""
        flat = pack(tensors).to(self.device)
        tag = message_tag(micro_batch, to_stage, direction, self.n_stages)
        work = dist.isend(flat, group=self.group, group_dst=self.stage_rank[to_stage], tag=tag)
        self.sends.append((work, flat))  # keep the buffer alive until the send completes

    def recv(self, specs: list[TensorSpec], from_stage: int, to_stage: int, micro_batch: int,
             direction: int) -> Pending:
        """Post a receive of tensors shaped ``specs`` coming from ``from_stage``."""
        numel = sum(math.prod(s.shape) for s in specs)
        buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
        tag = message_tag(micro_batch, to_stage, direction, self.n_stages)
        work = dist.irecv(buffer, group=self.group, group_src=self.stage_rank[from_stage],
                          tag=tag)
        return Pending(work, buffer, specs)

    def flush(self) -> None:
        """Wait for every send posted so far."""
        for work, _ in self.sends:
            if work is not None:
                work.wait()
        self.sends.clear()
