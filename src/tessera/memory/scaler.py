"""Dynamic loss scaling for fp16 chunks, with the interface of ``torch.amp.GradScaler``.

GradScaler looks for ``param.grad``, which chunked parameters never keep (gradients go straight
into gradient chunks), so chunk memory brings its own scaler. It checks the gradient chunks
this rank owns for inf/NaN, agrees on the answer over the data-parallel ranks, and on overflow
skips the update and halves the scale; after ``growth_interval`` clean steps it doubles it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tessera.memory.chunk import Kind

if TYPE_CHECKING:
    from tessera.memory.hybrid_adam import HybridAdam
    from tessera.memory.runtime import ChunkRuntime


class ChunkLossScaler:
    """fp16 loss scaler over gradient chunks (``scale``, ``unscale_``, ``step``, ``update``)."""

    def __init__(self, runtime: "ChunkRuntime", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.runtime, self.scale_value = runtime, init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps, self.found_inf, self.skipped = 0, False, 0
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer: "HybridAdam") -> None:
        """Divide the gradients by the scale and note whether any is inf or NaN."""
        rt = self.runtime
        rt.hooks.flush()
        bad = torch.zeros((), dtype=torch.float32)
        for chunk in rt.manager.own_chunks():
            grad = rt.readable(chunk, Kind.GRAD)
            if grad is None:
                continue
            if not torch.isfinite(grad).all():
                bad.fill_(1.0)
            grad.mul_(1.0 / self.scale_value)
        if rt.manager.world > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=rt.manager.zero.group)
        self.found_inf, self._unscaled = bool(bad.item()), True

    def step(self, optimizer: "HybridAdam") -> None:
        if not self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped += 1
            optimizer.skip_step()
        else:
            optimizer.step()

    def update(self) -> None:
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

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.clean_steps = state["scale"], state["clean_steps"]
