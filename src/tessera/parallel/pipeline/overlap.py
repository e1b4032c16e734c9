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
MAX_KEYS = 16  # step shapes whose gradient counts are remembered


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
        params: the parameters to average (local shards for DTensors), in model order; all
            must require gradients.
        group: the data-parallel process group (size > 1).
        bucket_bytes: (first bucket, later buckets) sizes in bytes.

    Use: :meth:`arm` before a step's schedule runs, :meth:`finish` after it drains (it
    launches what is left, waits for every bucket and writes the averages back), or
    :meth:`disarm` when the step failed. Without :meth:`arm`, :meth:`finish` averages
    everything then.
    """

    def __init__(self, params: list[nn.Parameter], group,
                 bucket_bytes: tuple[int, int] = (FIRST_BUCKET_BYTES, BUCKET_BYTES)) -> None:
        self.params, self.group = list(params), group
        self.buckets = _lay_out(self.params, bucket_bytes)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.counts: dict[object, dict[int, int]] = {}  # key -> id -> accumulations
        self.launched_in_backward = 0  # buckets the last step launched before the drain
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self.params]
        self._key = None
        self._target: dict[int, int] | None = None  # None: count, launch nothing early
        self._seen: dict[int, int] = {}
        self._launched = 0

    def arm(self, key, overlap: bool = True) -> None:
        """Start a step whose schedule is identified by ``key`` (hashable); ``overlap=False``
        only counts (the average then waits for :meth:`finish`)."""
        self._key, self._seen, self._launched = key, {}, 0
        self._target = self.counts.get(key) if overlap else None
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.expected = (0 if self._target is None
                               else sum(id(p) in self._target for p in bucket.params))

    def disarm(self) -> None:
        """Forget a failed step (buckets it launched are not waited for)."""
        for bucket in self.buckets:
            bucket.flat = bucket.work = None
        self._key, self._target, self._launched = None, None, 0

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the averages back."""
        if self._key is not None:
            self.launched_in_backward = self._launched
            if self._target is None:  # the first step with this key: remember its counts
                self._remember(self._key, dict(self._seen))
        try:
            while self._launched < len(self.buckets):
                self._launch(self._launched)
            for bucket in self.buckets:
                bucket.work.wait()
                _write_back(bucket)
        finally:  # a failed collective must not leave the next backward armed
            self.disarm()

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------------------- private
    def _remember(self, key, counts: dict[int, int]) -> None:
        if len(self.counts) >= MAX_KEYS:  # variable shapes: keep the most recent ones
            self.counts.pop(next(iter(self.counts)))
        self.counts[key] = counts

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
                f"{self._target.get(pid, 0)}); turn the overlap off to average only after the "
                f"backward (GradSync.overlap = False under pp, ShardGradSync.overlap = False "
                f"under tp at pp = 1)")
        if count == self._target.get(pid):
            self.buckets[index].ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all final."""
        while (self._launched < len(self.buckets)
               and self.buckets[self._launched].ready == self.buckets[self._launched].expected):
            self._launch(self._launched)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.flat = _flatten(bucket)  # one message per bucket
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, group=self.group,
                                      async_op=True)
        self._launched = index + 1


def _lay_out(params: list[nn.Parameter], bucket_bytes: tuple[int, int]) -> list[_Bucket]:
    """Buckets in reverse parameter order; a new one where dtype or device changes."""
    buckets: list[_Bucket] = []
    (limit, later), size, current = bucket_bytes, 0, []
    for param in reversed(params):
        local = local_shard(param)
        nbytes = local.numel() * local.element_size()
        if current and (size + nbytes > limit or _kind(current[-1]) != _kind(param)):
            buckets.append(_Bucket(current))
            limit, size, current = later, 0, []
        current.append(param)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


def average_now(params: list[nn.Parameter], group) -> None:
    """Average ``params``' gradients over ``group`` in one blocking message (what waits for
    the drain)."""
    bucket = _Bucket(list(params))
    bucket.flat = _flatten(bucket)
    dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, group=group)
    _write_back(bucket)


def _flatten(bucket: _Bucket) -> torch.Tensor:
    """The bucket's gradients (zeros where this rank has none) and, last, one flag per
    parameter: 1 where this rank has a gradient. Averaged, a flag says whether any rank had
    one: where none did, the gradient stays None, so the optimizer skips the parameter
    instead of decaying it with a zero gradient."""
    pieces, flags = [], []
    for param in bucket.params:
        local = local_shard(param)
        grad = None if param.grad is None else local_shard(param.grad)
        pieces.append(grad.reshape(-1) if grad is not None
                      else torch.zeros(local.numel(), dtype=local.dtype, device=local.device))
        flags.append(float(grad is not None))
    local = local_shard(bucket.params[0])
    pieces.append(torch.tensor(flags, dtype=local.dtype, device=local.device))
    return torch.cat(pieces)


def _write_back(bucket: _Bucket) -> None:
    flags = bucket.flat[-len(bucket.params):].tolist()
    offset = 0
    for param, flag in zip(bucket.params, flags):
        numel = local_shard(param).numel()
        if flag > 0:  # some rank had a gradient: every rank takes the average
            grad = grad_or_zeros(param)
            grad.copy_(bucket.flat[offset:offset + numel].view_as(grad))
        offset += numel


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a view: writes land in it); plain tensors as they are."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """This rank's gradient piece (zeros where the step gave none); writes land in .grad."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_shard(param.grad)


def _kind(param: nn.Parameter) -> tuple[torch.dtype, torch.device]:
    local = local_shard(param)
    return local.dtype, local.device
