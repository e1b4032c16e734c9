"""Dynamic loss scaling for fp16 chunks (:class:`tessera.loss_scale.DynamicLossScaler`).

GradScaler looks for ``param.grad``, which chunked parameters never keep (gradients go straight
into gradient chunks), so chunk memory brings its own scaler. It unscales the gradient chunks
this rank owns and agrees on any inf/NaN with every rank of the job (the ZeRO owners, and the
other stages under pipeline parallelism); on overflow the update is skipped (the optimizer
still ends its iteration) and the scale halved; after ``growth_interval`` clean steps doubled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tessera.loss_scale import DynamicLossScaler, unscale_tensors
from tessera.memory.chunk import Kind

if TYPE_CHECKING:
    from tessera.memory.hybrid_adam import HybridAdam
    from tessera.memory.runtime import ChunkRuntime


class ChunkLossScaler(DynamicLossScaler):
    """fp16 loss scaler over gradient chunks (``scale``, ``unscale_``, ``step``, ``update``)."""

    def __init__(self, runtime: "ChunkRuntime", **policy: Any) -> None:
        super().__init__(None, **policy)  # None: every rank of the job decides alike
        self.runtime = runtime

    def _unscale_local(self, inv_scale: float) -> torch.Tensor:
        rt = self.runtime
        rt.hooks.flush()
        grads = [rt.readable(chunk, Kind.GRAD) for chunk in rt.manager.own_chunks()]
        return unscale_tensors([g for g in grads if g is not None], inv_scale,
                               rt.manager.device.device)

    def _skip(self, optimizer: "HybridAdam") -> None:
        optimizer.skip_step()
