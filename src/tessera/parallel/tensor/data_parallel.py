"""Data parallelism over tensor-parallel shards.

DistributedDataParallel cannot take DTensor parameters (it broadcasts and buckets plain
tensors), so under tp > 1 the shards' gradients are averaged over the dp group here. In the
Engine's step (:meth:`ShardGradSync.step`, entered around the micro-batch that syncs) they go
in DDP-sized buckets, each launched asynchronously as soon as its gradients are final, while
backward goes on (the pipeline's :class:`OverlappedAverage`); a backward outside it (a user's
own loop) averages each gradient as it completes, in one blocking message per parameter. The
module gets DDP's ``no_sync()``, which the Engine uses to skip the average on all but the last
micro-batch of gradient accumulation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.pipeline.overlap import OverlappedAverage, local_shard


class ShardGradSync:
    """Averages every parameter's (local) gradient over ``group`` after backward.

    Args:
        model: whose parameters to hook.
        group: the data-parallel process group.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.enabled = group, dist.get_world_size(group), True
        params = [param for param in model.parameters() if param.requires_grad]
        for param in params:
            param.register_post_accumulate_grad_hook(self._average_alone)
        self.buckets = OverlappedAverage(params, group)
        self.overlap = True  # False: buckets launch only after the backward
        self._in_step = False

    def _average_alone(self, param: torch.Tensor) -> None:
        """A gradient completed outside :meth:`step`: average it now, on its own."""
        if not self.enabled or self._in_step or param.grad is None:
            return
        grad = local_shard(param.grad)
        dist.all_reduce(grad, group=self.group)  # sum, then divide: the mean
        grad.div_(self.size)

    @contextlib.contextmanager
    def step(self, key=None):
        """Around the forward and backward whose gradients are averaged: in buckets, launched
        during the backward once the first step with ``key`` (the batch shape) has counted
        which gradients that backward completes (that first step launches them all after
        it); every average is written back on exit. A parameter no rank has a gradient for
        keeps ``grad = None``."""
        if not self.enabled:
            yield
            return
        self.buckets.arm(("step", key), self.overlap)
        self._in_step = True
        try:
            yield
        except BaseException:
            self.buckets.disarm()
            raise
        else:
            self.buckets.finish()  # disarms, also when a collective fails
        finally:
            self._in_step = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (like DDP.no_sync)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def attach(self, module: nn.Module) -> None:
        """Give ``module`` the ``no_sync()`` the Engine looks for, and the bucketed
        ``grad_sync_step(key)`` it enters around the micro-batch that syncs."""
        object.__setattr__(module, "no_sync", self.no_sync)
        object.__setattr__(module, "grad_sync_step", self.step)
