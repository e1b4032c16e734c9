"""Dynamic fp16 loss scaling that every rank of a job agrees on.

fp16 keeps 5 exponent bits: gradients below about 6e-8 flush to zero. The loss is multiplied by
a large scale before backward, and the gradients divided by it before the update. When any
gradient came out inf or NaN the update is skipped and the scale lowered; after
``growth_interval`` clean steps it is raised again (the policy of ``torch.amp.GradScaler``).

``torch.amp.GradScaler`` decides per rank, from the gradients that rank holds. That is right
when every rank holds every gradient (data parallelism), but a pipeline stage, or a chunk
owner, holds only its share: an overflow on one stage must skip the update on all of them, or
the stages would train different steps. :class:`DynamicLossScaler` therefore all-reduces the
overflow flag over a process group spanning the job before deciding; subclasses say where the
gradients are.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn


class DynamicLossScaler:
    """``scale``, ``unscale_``, ``step``, ``update`` as ``torch.amp.GradScaler`` has them.

    Args:
        group: the ranks that must take the same decision (None: every rank of the job).
        init_scale, growth_factor, backoff_factor, growth_interval: as in GradScaler.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"loss scaling needs init_scale > 0, growth_factor > 1 and "
                             f"0 < backoff_factor < 1; got {init_scale}, {growth_factor}, "
                             f"{backoff_factor}")
        self.group, self.scale_value = group, float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps, self.found_inf, self.skipped = 0, False, 0
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: Any) -> None:
        """Divide this rank's gradients by the scale; agree with the group on any inf/NaN."""
        flag = self._unscale_local(1.0 / self.scale_value).float()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf, self._unscaled = bool(flag.item()), True

    def step(self, optimizer: Any) -> None:
        """The optimizer's step, or none when a gradient of any rank overflowed."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped += 1
            self._skip(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        """Lower the scale after an overflow; raise it after growth_interval clean steps."""
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0
        self.found_inf, self._unscaled = False, False

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale_value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])

    # ------------------------------------------------------------------ for subclasses
    def _unscale_local(self, inv_scale: float) -> torch.Tensor:
        """Multiply this rank's gradients by ``inv_scale``; a bool tensor: any inf or NaN?
        (on the device the group's backend reduces: NCCL takes device tensors only)"""
        raise NotImplementedError

    def _skip(self, optimizer: Any) -> None:
        """What an optimizer needs when its update is skipped (nothing, for torch's)."""


class GradLossScaler(DynamicLossScaler):
    """Loss scaling over the ``.grad`` of parameters (a pipeline stage's, for instance).

    Args:
        params: the parameters whose gradients this rank holds (DTensors: their local shards
            are unscaled, the group covers the other shards).
        group: see :class:`DynamicLossScaler`.
        device: where the overflow flag lives (default: the first parameter's device). A
            rank with no parameters (a pipeline stage holding only rows of another stage's
            weight) must still pass its accelerator: NCCL reduces device tensors only.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, **policy: Any) -> None:
        super().__init__(group, **policy)
        self.params = list(params)
        self.device = device or (self.params[0].device if self.params else torch.device("cpu"))

    def _unscale_local(self, inv_scale: float) -> torch.Tensor:
        return unscale_tensors([getattr(p.grad, "_local_tensor", p.grad) for p in self.params
                                if p.grad is not None], inv_scale, self.device)


def unscale_tensors(grads: list[torch.Tensor], inv_scale: float, device: torch.device
                    ) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; a bool tensor on ``device``: whether any
    held an inf or NaN (one host sync at the caller's reduction, not one per tensor)."""
    flags = [(~torch.isfinite(g)).any().to(device) for g in grads]
    for grad in grads:
        grad.mul_(inv_scale)
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool,
                                                                device=device)
