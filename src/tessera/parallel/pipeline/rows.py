"""Stages that read a weight only through row slices hold only those rows.

A sliced LM head (``head.py``) reads its weight ``W`` (V, C) as ``W[lo:hi]`` slice by slice,
and the slices are spread over the last stages. Held whole on every such stage (with its
gradient and two AdamW moments), ``W`` would cost ``4 V C`` floats on each of them. Instead,
each weight read only through row slices has one *home* rank that holds it whole, as any
other weight: the lowest rank reading it other than by row slices (GPT-2's embedding, tied to
the head), else the lowest rank holding a slice. Every other rank reading it through slices
holds a plain tensor of just its rows ``[a, b)`` (the span of its slices), with no optimizer
state; it is neither in the rank's StageModule nor in its checkpoint.

Per step:

- before the stages run (training and evaluation alike), the home sends each row holder its
  rows (so an optimizer step, a checkpoint load or ``init_from`` on the home reaches them);
- after the backward, each row holder sends its rows' gradient to the home, which adds it
  into ``W.grad[a:b]``; the home's gradient is then the sum a single device accumulates, and
  the tied-weight, data-parallel, clipping and optimizer rules apply to it as to any weight.

Not used with chunk memory, whose gradients and weights live in chunks sharded over dp (the
head is then held whole by every stage reading it, as tied weights are).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from tessera.parallel.pipeline.capture import ProxyGraph

aten = torch.ops.aten
_TAG = 1 << 24  # clear of the schedule's message tags (comm.message_tag)


@dataclass
class RowShare:
    """One rank's rows ``[start, stop)`` of the weight first named ``name``."""

    name: str
    home: int  # pp-group rank holding the weight whole
    holder: int  # pp-group rank holding the rows
    start: int
    stop: int


def row_slice(node: fx.Node) -> tuple[int, int] | None:
    """``(lo, hi)`` when ``node`` is ``aten.slice(param, 0, lo, hi)`` with step 1, else None."""
    if node.target is not aten.slice.Tensor:
        return None
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    dim, lo, hi, step = args[1:5]
    if dim != 0 or step != 1 or not isinstance(lo, int) or not isinstance(hi, int):
        return None
    return lo, hi


def row_reads(graph: ProxyGraph, users: list[int]) -> list[tuple[int, tuple[int, int] | None]]:
    """For each compute index reading a weight (once each, in order), the rows it reads as a
    row slice, or None when it reads the weight otherwise (whole)."""
    return [(i, row_slice(graph.nodes[graph.compute[i]].node)) for i in sorted(set(users))]


def find_row_shares(graph: ProxyGraph, stage_of: dict[str, int], stage_rank: list[int],
                    first_name: dict[str, str]) -> list[RowShare]:
    """The row shares of every weight some rank reads only through row slices.

    ``first_name`` maps a parameter placeholder to its weight's first name. The list is in
    one order on every rank (by name, then holder), so their transfers pair up.
    """
    shares = []
    for pname, users in graph.param_users.items():
        value = graph.nodes[pname].node.meta["val"]
        if not users or value.dim() == 0:  # a scalar has no rows to share
            continue
        rows = value.shape[0]
        whole: set[int] = set()
        spans: dict[int, tuple[int, int]] = {}
        for i, span in row_reads(graph, users):
            rank = stage_rank[stage_of[graph.compute[i]]]
            if span is None:
                whole.add(rank)
                continue
            lo, hi = max(span[0], 0), min(span[1], rows)
            old = spans.get(rank, (lo, hi))
            spans[rank] = (min(old[0], lo), max(old[1], hi))
        home = min(whole) if whole else min(spans, default=None)
        for rank in sorted(set(spans) - whole - {home}):
            shares.append(RowShare(first_name[pname], home, rank, *spans[rank]))
    return sorted(shares, key=operator.attrgetter("name", "holder"))


class RowHolding:
    """This rank's part in the row shares: the rows it holds and the transfers it joins.

    Args:
        shares: every rank's shares (:func:`find_row_shares`), in the same order everywhere.
        weights: this rank's model weights by first name (the home's whole ``W``).
        aliases: first name -> every name of the weight (bindings cover each).
        pp_group: the pipeline group; ``pp_rank`` this rank's place in it.
        device: where this rank's rows live.
    """

    def __init__(self, shares: list[RowShare], weights: dict[str, nn.Parameter],
                 aliases: dict[str, list[str]], pp_group, pp_rank: int,
                 device: torch.device) -> None:
        self.shares, self.group, self.rank = shares, pp_group, pp_rank
        self.weights = weights
        self.rows: dict[str, nn.Parameter] = {}  # first name -> this rank's rows
        self.bindings: dict[str, tuple[torch.Tensor, int]] = {}  # any name -> (rows, start)
        for share in shares:
            if share.holder != pp_rank:
                continue
            like = weights[share.name]
            # NaN until the first refresh, so a use before it cannot pass unnoticed.
            rows = nn.Parameter(torch.full((share.stop - share.start, *like.shape[1:]),
                                           float("nan"), dtype=like.dtype, device=device))
            self.rows[share.name] = rows
            for alias in aliases[share.name]:
                self.bindings[alias] = (rows, share.start)

    def refresh(self) -> None:
        """Copy each holder's rows from the home's current weight."""
        works = []
        for i, share in enumerate(self.shares):
            if share.home == self.rank:
                rows = self.weights[share.name].detach()[share.start:share.stop].contiguous()
                works.append((dist.isend(rows, group=self.group, group_dst=share.holder,
                                         tag=_TAG + i), rows))
            elif share.holder == self.rank:  # straight into the rows' storage
                dist.irecv(self.rows[share.name].detach(), group=self.group,
                           group_src=share.home, tag=_TAG + i).wait()
        for work, _ in works:
            work.wait()

    def reduce_grads(self) -> None:
        """Add each holder's rows' gradient into the home's ``W.grad[a:b]``; holders then
        drop theirs."""
        works = []
        for i, share in enumerate(self.shares):
            if share.holder == self.rank:
                rows = self.rows[share.name]
                grad = (rows.grad if rows.grad is not None else torch.zeros_like(rows)
                        ).contiguous()
                works.append((dist.isend(grad, group=self.group, group_dst=share.home,
                                         tag=_TAG + i), grad))
            elif share.home == self.rank:
                weight = self.weights[share.name]
                part = torch.empty((share.stop - share.start, *weight.shape[1:]),
                                   dtype=weight.dtype, device=weight.device)
                dist.irecv(part, group=self.group, group_src=share.holder,
                           tag=_TAG + i).wait()
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                weight.grad[share.start:share.stop] += part
        for work, _ in works:
            work.wait()
        for rows in self.rows.values():
            rows.grad = None
