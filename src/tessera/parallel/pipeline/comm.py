"""Point-to-point messages between pipeline stages (the communication half of the pipeline).

A message is every tensor crossing one stage boundary for one micro-batch, packed into one
flat fp32 buffer: one send per boundary instead of one per tensor. Sends are asynchronous and
waited at the end of the step; a rank only ever blocks in :meth:`Pending.wait`, for a message
the schedule guarantees its neighbour sends without waiting on this rank first.

Every directed pair of ranks that exchanges messages talks on a *channel*
(:func:`stage_channels`): a process group of that direction only (one per pair slot, shared
by all pipelines, in which each pair is its own connection). NCCL ignores tags and
matches the n-th send of a pair with the n-th receive, and it runs all operations of one
communicator on one stream, where a receive blocks what was queued after it: with both
directions on one communicator, a stage that posts its next receive before its next send
(as the engine does, one action ahead) waits on a neighbour doing the same. On a channel the
sender only sends and the receiver only receives, and both do so in the same order
(:func:`message_plan`, pinned by tests for every schedule), so the n-th send is the n-th
receive. Messages also carry a tag of (micro-batch, stage, direction), which gloo matches.
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


Key = tuple[str, int, int]  # (kind "F"/"B", receiving stage, micro-batch) of one message


@dataclass(frozen=True)
class Step:
    """What the engine communicates around one action: the receives it posts before running
    the action (the action's own and the next one's, so a message is usually there when it
    is needed) and the message it sends after it (None: nothing)."""

    receives: tuple[Key, ...]
    send: Key | None


def message_plan(actions, n_stages: int) -> list[Step]:
    """The engine's communication for one rank's ``actions``, one :class:`Step` per action.

    A forward of stage s > 0 receives from s - 1 and one of s < n_stages - 1 sends to s + 1;
    a backward receives from s + 1 and sends to s - 1, the other way."""
    posted: set[Key] = set()
    plan = []
    for i, action in enumerate(actions):
        receives = []
        for ahead in actions[i:i + 2]:
            key = (ahead.kind, ahead.stage, ahead.mb)
            if key not in posted and source_stage(key, n_stages) is not None:
                posted.add(key)
                receives.append(key)
        plan.append(Step(tuple(receives), _sent_after(action, n_stages)))
    return plan


def source_stage(key: Key, n_stages: int) -> int | None:
    """The stage that sends message ``key`` (None: that action receives nothing)."""
    kind, stage, _ = key
    source = stage - 1 if kind == "F" else stage + 1
    return source if 0 <= source < n_stages else None


def _sent_after(action, n_stages: int) -> Key | None:
    to = action.stage + 1 if action.kind == "F" else action.stage - 1
    return (action.kind, to, action.mb) if 0 <= to < n_stages else None


@dataclass(frozen=True)
class Channel:
    """The process group of one directed pair of ranks, and the other end's global rank."""

    group: dist.ProcessGroup
    peer: int


def channel_pairs(stage_rank: list[int]) -> list[tuple[int, int]]:
    """Directed (from, to) pairs of pp ranks that pipeline messages travel between."""
    pairs = set()
    for s in range(len(stage_rank) - 1):
        a, b = stage_rank[s], stage_rank[s + 1]
        pairs |= {(a, b), (b, a)}  # forward s -> s + 1, backward s + 1 -> s
    return sorted(pairs)


def stage_channels(pp_groups: list[list[int]], stage_rank: list[int],
                   device: torch.device) -> dict[tuple[int, int], Channel]:
    """A process group per directed pair of pp ranks that exchanges messages; returns this
    rank's channels, keyed by (from pp rank, to pp rank).

    One group per pair *slot* (from, to), over that pair in every pipeline group: 2(pp - 1)
    groups (2pp when interleaving wraps around), however many pipelines the job has. Inside
    a group each pair is its own point-to-point connection, and the two directions of a pair
    are different groups. A collective: every rank calls it with the same ``pp_groups``
    (global ranks of each pipeline group, ordered by pp rank). Each channel then carries one
    message of warm-up, every rank taking its channels in the same global order, so that
    backends which connect a pair on its first message (NCCL) do so here, where no schedule
    can interleave them.
    """
    me, mine = dist.get_rank(), {}
    (own,) = [ranks for ranks in pp_groups if me in ranks]
    slots = channel_pairs(stage_rank)
    groups = {slot: dist.new_group(sorted({r[i] for r in pp_groups for i in slot}))
              for slot in slots}  # every rank, same order
    for ranks in pp_groups:  # warm-up, in one global order
        for a, b in slots:
            src, dst = ranks[a], ranks[b]
            if me not in (src, dst):
                continue
            probe = torch.zeros(1, device=device)
            if me == src:
                dist.send(probe, dst=dst, group=groups[(a, b)])
            else:
                dist.recv(probe, src=src, group=groups[(a, b)])
    for a, b in slots:
        if me in (own[a], own[b]):
            mine[(a, b)] = Channel(groups[(a, b)], own[b] if me == own[a] else own[a])
    return mine


class StageLink:
    """Sends and receives between virtual stages placed on the ranks of a pipeline group.

    Args:
        channels: this rank's channels (:func:`stage_channels`), by (from, to) pp rank.
        stage_rank: pp rank that runs each virtual stage.
        device: where receive buffers live.
    """

    def __init__(self, channels: dict[tuple[int, int], Channel], stage_rank: list[int],
                 device: torch.device) -> None:
        self.channels, self.stage_rank, self.device = channels, stage_rank, device
        self.n_stages = len(stage_rank)
        self.sends: list = []

    def send(self, tensors: list[torch.Tensor], key: Key) -> None:
        """Post an asynchronous send of ``tensors`` as message ``key``."""
        flat = pack(tensors).to(self.device)
        channel = self._channel(key)
        work = dist.isend(flat, dst=channel.peer, group=channel.group, tag=self._tag(key))
        self.sends.append((work, flat))  # keep the buffer alive until the send completes

    def recv(self, specs: list[TensorSpec], key: Key) -> Pending:
        """Post a receive of message ``key``, tensors shaped ``specs``."""
        numel = sum(math.prod(s.shape) for s in specs)
        buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
        channel = self._channel(key)
        work = dist.irecv(buffer, src=channel.peer, group=channel.group, tag=self._tag(key))
        return Pending(work, buffer, specs)

    def flush(self) -> None:
        """Wait for every send posted so far."""
        for work, _ in self.sends:
            if work is not None:
                work.wait()
        self.sends.clear()

    def _channel(self, key: Key) -> Channel:
        source = source_stage(key, self.n_stages)
        return self.channels[(self.stage_rank[source], self.stage_rank[key[1]])]

    def _tag(self, key: Key) -> int:
        kind, stage, mb = key
        return message_tag(mb, stage, FORWARD if kind == "F" else BACKWARD, self.n_stages)
