"""The engine runs one optimizer step's micro-batches: forward, loss, backward.

This is the single-stage engine (pp == 1): micro-batches run one after another, each forward
then backward, gradients accumulating; data-parallel gradient synchronisation happens only on
the last one. On one stage every pipeline schedule (gpipe, 1f1b, scp) computes exactly these
gradients; the pipeline engine takes over when pp > 1.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tessera.parallel.loss_weights import TokenWeights, check_weights, equal_weights
from tessera.parallel.plan import Parallelized, causal_lm_logits, lm_loss
from tessera.strategy import Strategy

__all__ = ["Engine", "StepResult", "causal_lm_logits", "lm_loss"]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    """What one optimizer step's forward/backward produced on this rank."""

    loss: torch.Tensor  # sum_i w_i * loss_i over this rank's micro-batches (detached, fp32)
    tokens: int  # tokens this rank processed


class Engine:
    """Forward/backward over micro-batches with autocast, loss scaling and no_sync.

    Args:
        plan: what :func:`tessera.parallel.parallelize` returned.
        strategy: gives the precision.
        device: where batches go.
    """

    def __init__(self, plan: Parallelized, strategy: Strategy, device: torch.device) -> None:
        self.plan, self.model, self.device = plan, plan.module, device
        self.dtype = _AUTOCAST_DTYPES.get(strategy.precision)
        if self.dtype is not None and not _autocast_supported(device.type, self.dtype):
            raise RuntimeError(f"precision={strategy.precision} is not supported on "
                               f"{device.type} by this torch build")
        # fp16 has a narrow range: scale the loss so small gradients do not underflow.
        self.scaler = (torch.amp.GradScaler(device.type) if strategy.precision == "fp16"
                       else None)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                         weights: TokenWeights | None = None) -> StepResult:
        """Accumulate gradients of ``sum_i weights[i] * loss_i`` over ``micro_batches``.

        ``weights`` default to 1/n each (the mean of the micro-batches' means); the Trainer
        passes :func:`tessera.parallel.loss_weights.token_weights`, the mean over labels.
        """
        total = torch.zeros((), device=self.device)
        tokens = 0
        n = len(micro_batches)
        weights = equal_weights(n, self.device) if weights is None else weights
        check_weights(weights, n)
        with self._step_casts():
            for i, batch in enumerate(micro_batches):
                batch = {key: self._to_device(value) for key, value in batch.items()}
                # DDP reads its sync flag during forward: both passes go inside no_sync.
                with self._grad_sync_context(sync=i == n - 1, key=tuple(batch["input_ids"].shape)):
                    with self.autocast():
                        loss = self.plan.loss(batch)
                    scaled = loss * weights[i]
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    scaled.backward()
                total += loss.detach() * weights[i]
                tokens += batch["input_ids"].numel()
        return StepResult(loss=total, tokens=tokens)

    def _step_casts(self):
        """Keeps autocast's 16-bit copies of the fp32 weights for the whole step, so each
        micro-batch after the first casts nothing: a disabled outer autocast context stops
        each forward's own context from clearing the cache (backward runs outside autocast
        as before). Not with recomputation (tessera's, or a Hugging Face model's own
        gradient checkpointing), whose recomputed layers would then keep their copies cached
        for the rest of the step instead of one layer's at a time; its forwards under no_grad
        also meet a torch bug before the fix of pytorch#158232 (a cast cached there, without
        its gradient's history, served the next forward)."""
        if (self.dtype is None or "recompute" in self.plan.features
                or _checkpoints_itself(self.plan.model)):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one batch without gradients."""
        batch = {key: self._to_device(value) for key, value in batch.items()}
        with self.autocast():
            return self.plan.loss(batch)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor
        # Pinned host memory lets the copy run asynchronously with the current kernels.
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _grad_sync_context(self, sync: bool, key=None):
        """``no_sync()`` unless ``sync``; where gradients are synced, the module's
        ``grad_sync_step(key)`` if it has one (tensor-parallel shards' bucketed average)."""
        if sync:
            step = getattr(self.model, "grad_sync_step", None)
            return contextlib.nullcontext() if step is None else step(key)
        no_sync = getattr(self.model, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()


def _checkpoints_itself(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model's own gradient checkpointing is on (its layers carry
    ``gradient_checkpointing = True``; read directly, the model's property is deprecated)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    try:
        with torch.autocast(device_type, dtype=dtype):
            torch.ones(2, 2, device=device_type) @ torch.ones(2, 2, device=device_type)
        return True
    except (RuntimeError, AssertionError):
        return False
