"""Communication of tensor parallelism: the only file here that calls torch.distributed.

Two kinds of object:

- ``TPGroup`` / ``Grid``: which ranks talk (taken from the Mesh, never global) and thin
  wrappers over the collectives the algorithms need. ``Grid`` is the q x q Optimus grid:
  rank (i, j) sits at grid row i and grid column j. "Along the row" means among the ranks
  (i, *), which is the Mesh's ``tp_col`` group (the column index varies); "along the column"
  means among (*, j), the Mesh's ``tp_row`` group.
- Megatron's conjugate pair f / g as autograd functions (identity forward and all-reduce
  backward, and the reverse). The layers' own functions pair all-gather with reduce-scatter
  the same way for sequence parallelism.

Every byte a collective moves is added to ``CommCounter`` when one is installed on the group
object, so the benchmark can compare measured traffic with the analytic formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from tessera.distributed import reduce_scatter_flat


@dataclass
class CommCounter:
    """Bytes this rank sent into collectives, by kind (payload size, not wire bytes)."""

    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()

    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class Started:
    """A collective under way: :meth:`wait` returns its result (``result`` reads it once the
    work is done; ``work`` None: nothing to wait for)."""

    work: object | None
    result: Callable[[], torch.Tensor]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.result()


class TPGroup:
    """One process group of tensor parallelism (the 1D tp group, or a grid row/column).

    Args:
        group: the process group.
        counter: optional byte counter for benchmarks.
    """

    def __init__(self, group: dist.ProcessGroup, counter: CommCounter | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counter = counter

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        if self.counter is not None:
            self.counter.add(kind, tensor)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce; returns ``tensor``."""
        if self.size > 1:
            self._count("all_reduce", tensor)
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_reduce_start(self, tensor: torch.Tensor) -> "Started":
        """Start an in-place sum of ``tensor`` (gloo runs it on its own thread, NCCL on its
        own stream); its ``wait()`` returns ``tensor`` summed."""
        if self.size == 1:
            return Started(None, lambda: tensor)
        self._count("all_reduce", tensor)
        return Started(dist.all_reduce(tensor, group=self.group, async_op=True),
                       lambda: tensor)

    def all_gather_start(self, tensor: torch.Tensor, dim: int) -> "Started":
        """Start :meth:`all_gather` (gloo on its own thread, NCCL on its own stream)."""
        if self.size == 1:
            return Started(None, lambda: tensor)
        tensor = tensor.contiguous()
        self._count("all_gather", tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        work = dist.all_gather(parts, tensor, group=self.group, async_op=True)
        return Started(work, lambda: torch.cat(parts, dim=dim))

    def reduce_scatter_start(self, tensor: torch.Tensor, dim: int) -> "Started":
        """Start :meth:`reduce_scatter` (as :meth:`all_gather_start`)."""
        if self.size == 1:
            return Started(None, lambda: tensor)
        flat = torch.stack(tensor.chunk(self.size, dim=dim))  # (size, *part): one copy
        self._count("reduce_scatter", tensor)
        out = torch.empty_like(flat[0])
        work = reduce_scatter_flat(out, flat, self.group, async_op=True)
        return Started(work, lambda: out)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
        return self.all_gather_start(tensor, dim).wait()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, then keep this rank's chunk of ``dim``."""
        return self.reduce_scatter_start(tensor, dim).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In-place broadcast from the group's rank ``src``; returns ``tensor``."""
        if self.size > 1:
            if self.rank == src:
                self._count("broadcast", tensor)
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        return tensor

    def reduce(self, tensor: torch.Tensor, dst: int) -> torch.Tensor:
        """In-place sum onto the group's rank ``dst`` (other ranks' ``tensor`` is clobbered)."""
        if self.size > 1:
            self._count("reduce", tensor)
            dist.reduce(tensor, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return tensor


class Grid:
    """The q x q Optimus grid of this rank: coordinates and the row and column groups.

    Args:
        row: the ranks (i, *) of this rank's grid row (Mesh axis ``tp_col``).
        col: the ranks (*, j) of this rank's grid column (Mesh axis ``tp_row``).
        flat: all q*q ranks (Mesh axis ``tp``).
    """

    def __init__(self, row: TPGroup, col: TPGroup, flat: TPGroup) -> None:
        self.row, self.col, self.flat = row, col, flat
        self.q = row.size
        self.i, self.j = col.rank, row.rank  # grid row index, grid column index

    @classmethod
    def from_mesh(cls, mesh, counter: CommCounter | None = None) -> "Grid":
        return cls(TPGroup(mesh.group("tp_col"), counter), TPGroup(mesh.group("tp_row"), counter),
                   TPGroup(mesh.group("tp"), counter))


# ------------------------------------------------------------------ 1D autograd collectives
class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of partial results), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherSeq(torch.autograd.Function):
    """Sequence parallelism: all-gather the sequence dim (1) forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x, dim=1)  # (B, T/tp, C) -> (B, T, C)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.reduce_scatter(grad, dim=1), None


class ScatterSeq(torch.autograd.Function):
    """Sequence parallelism: keep this rank's chunk of the sequence dim (1) forward, all-gather
    the gradient backward (each rank's chunk carries its own rows of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return own_rows(x, group)  # (B, T, C) -> (B, T/tp, C)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_gather(grad.contiguous(), dim=1), None


class GatherSeqWhole(GatherSeq):
    """Sequence parallelism ending: all-gather the sequence dim (1) for computation every rank
    repeats whole (a Hugging Face model's final norm and head); its gradient arrives whole and
    equal on every rank, so the backward keeps this rank's chunk (no sum)."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return own_rows(grad, ctx.group), None


def own_rows(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """This rank's chunk of the sequence dim (1): (B, T, ...) -> (B, T/tp, ...), always a new
    tensor (a custom op may not return a view of its input, and with B = 1 the chunk is
    contiguous already: ``contiguous()`` would return the view)."""
    rows = x.shape[1] // group.size
    return x.narrow(1, group.rank * rows, rows).clone(memory_format=torch.contiguous_format)


class GatheredInput:
    """A block input gathered from sequence shards (Megatron sequence parallelism), as its
    column layers keep it for backward: each keeps the rank's shard, not the gathered
    (B, T, C), and the first of them to run backward gathers it again, once for all of them
    (Megatron-LM's re-gather: t times less kept per block input, one all-gather more per block
    in backward). Made in the forward by the block's pre-hook; ``readers`` counts the column
    layers that kept the shard; the gathered copy is dropped when the last has used it."""

    ATTRIBUTE = "tessera_gathered_from"  # on the gathered tensor: (shard, this object)

    def __init__(self, group: TPGroup) -> None:
        self.group, self.readers = group, 0
        self._full: torch.Tensor | None = None

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered input (B, T, C) from this rank's ``shard`` (B, T/tp, C), in backward."""
        if self._full is None:
            self._full = self.group.all_gather(shard, dim=1)
        full = self._full
        self.readers -= 1
        if self.readers <= 0:
            self._full = None
        return full
