"""Data-parallel gradient averaging overlapped with a pipeline stage's last backward.

Under dp x pp a rank's gradients are final once its stages' last micro-batch has run
backward. :class:`OverlappedAverage` averages them over the dp group in buckets (torch DDP's
sizes: a first bucket of 1 MiB, then 25 MiB), each launched asynchronously as soon as every
gradient in it is final, while the backward goes on with earlier layers.

When is a gradient final? When it has received as many accumulations as in the first step
with the same key (micro-batch count and batch shape): that step counts them and averages
everything after the pipeline drains; later steps with the key overlap. The counts come from
what autograd did, not from a model of the schedule, so any schedule, recomputation or
weight used by two local stages is covered.

Every dp rank lays its buckets out in one order (the reverse of its parameters' order, about
the order in which backward finishes them) and launches them strictly in that order, so the
ranks' collectives pair up whatever their local timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

FIRST_BUCKET_BYTES = 2**20  # small, so the first all-reduce starts early (as in DDP)
BUCKET_BYTES = 25 * 2**20


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor | None = None
    work: object | None = None
    ready: int = 0  # parameters of this bucket whose gradient is final this step
    expected: int = 0  # parameters that had a gradient in the recorded step


class OverlappedAverage:
    """Averages ``params``' gradients over ``group``, overlapping the last backward.

    Args:
        params: the parameters to average (local shards for DTensors), in model order.
        group: the data-parallel process group (size > 1).
        bucket_bytes: (first bucket, later buckets) sizes in bytes.

    Use: :meth:`arm` before a step's schedule runs, :meth:`finish` after it drains (it
    launches what is left, waits for every bucket and writes the averages back).
    Without :meth:`arm`, :meth:`finish` averages everything then.
    """

    def __init__(self, params: list[nn.Parameter], group,
                 bucket_bytes: tuple[int, int] = (FIRST_BUCKET_BYTES, BUCKET_BYTES)) -> None:
        self.params, self.group, self.bucket_bytes = list(params), group, bucket_bytes
        self.launched_in_backward = 0  # buckets the last step launched before the drain
        self.enabled = True  # False: average after the pipeline drains (for measurement)
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, int] = {}
        self.counts: dict[object, dict[int, int]] = {}  # key -> id -> accumulations
        self._handles: list = []
        self._key = None
        self._target: dict[int, int] | None = None
        self._seen: dict[int, int] = {}
        self._launched = 0

    def arm(self, key) -> None:
        """Start a step whose schedule is identified by ``key`` (hashable)."""
        if not self.buckets:
            self._lay_out()
        self._key, self._seen, self._launched = key, {}, 0
        self.launched_in_backward = 0
        self._target = self.counts.get(key) if self.enabled else None
        for bucket in self.buckets:
            bucket.flat, bucket.work, bucket.ready = None, None, 0
            bucket.expected = (0 if self._target is None
                               else sum(id(p) in self._target for p in bucket.params))

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the averages back."""
        if not self.buckets:
            self._lay_out()
        if self._key is not None and self._target is None:
            self.counts[self._key] = dict(self._seen)  # the first step with this key
        if self._key is not None:
            self.launched_in_backward = self._launched
        while self._launched < len(self.buckets):
            self._launch(self._launched)
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for param in bucket.params:
                grad = _local_grad(param)
                grad.copy_(bucket.flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            bucket.flat = bucket.work = None
        self._key, self._target = None, None

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------------------- private
    def _lay_out(self) -> None:
        """Buckets in reverse parameter order; a new one where dtype or device changes."""
        (limit, later), size, current = self.bucket_bytes, 0, []
        for param in reversed(self.params):
            local = _local(param)
            nbytes = local.numel() * local.element_size()
            if current and (size + nbytes > limit or _kind(current[-1]) != _kind(param)):
                self.buckets.append(_Bucket(current))
                limit, size, current = later, 0, []
            current.append(param)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self.params]

    @torch.no_grad()
    def _on_grad(self, param: nn.Parameter) -> None:
        if self._key is None:
            return  # a backward outside the pipeline's step
        pid = id(param)
        count = self._seen[pid] = self._seen.get(pid, 0) + 1
        if self._target is None:
            return
        index = self.bucket_of[pid]
        if index < self._launched:
            raise RuntimeError(
                f"a gradient (parameter of shape {tuple(param.shape)}) arrived after its "
                f"data-parallel bucket was averaged: this step accumulated it more often than "
                f"the first step with the same micro-batches and shapes did ({count} > "
                f"{self._target.get(pid, 0)}); set GradSync.overlap = False to average only "
                f"after the pipeline drains")
        if count == self._target.get(pid):
            self.buckets[index].ready += 1
            while (self._launched < len(self.buckets)
                   and self.buckets[self._launched].ready
                   == self.buckets[self._launched].expected):
                self._launch(self._launched)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        grads = [_local_grad(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])  # one message per bucket
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, group=self.group,
                                      async_op=True)
        self._launched = index + 1


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's gradient piece (zeros where the step gave none); writes land in .grad."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return _local(param.grad)


def _kind(param: nn.Parameter) -> tuple[torch.dtype, torch.device]:
    local = _local(param)
    return local.dtype, local.device
