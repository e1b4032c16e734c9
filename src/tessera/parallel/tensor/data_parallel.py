"""Data parallelism over tensor-parallel shards.

DistributedDataParallel cannot take DTensor parameters (it broadcasts and buckets plain
tensors), so under tp > 1 each shard's gradient is averaged over the dp group by a hook that
runs once its gradient is complete for the step. The module gets DDP's ``no_sync()``, which
the Engine uses to skip the average on all but the last micro-batch of gradient accumulation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class ShardGradSync:
    """Averages every parameter's (local) gradient over ``group`` after backward.

    Args:
        model: whose parameters to hook.
        group: the data-parallel process group.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.enabled = group, dist.get_world_size(group), True
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        if not self.enabled or param.grad is None:
            return
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, group=self.group)  # gloo has no AVG: sum, then divide
        grad.div_(self.size)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (like DDP.no_sync)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def attach(self, module: nn.Module) -> None:
        """Give ``module`` the ``no_sync()`` the Engine looks for."""
        object.__setattr__(module, "no_sync", self.no_sync)
