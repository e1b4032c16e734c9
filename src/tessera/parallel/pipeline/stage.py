"""One virtual stage at run time: forward, recomputation and backward of a micro-batch.

A stage is one graph piece, or two when it recomputes: a *head* whose activations are dropped
after the forward (run under no_grad, only its inputs kept) and a *tail* that keeps them.
Before the backward the head runs again with gradients, from the same RNG state so dropout
masks repeat. Doing that recomputation as its own call (rather than inside
torch.utils.checkpoint) is what lets the shifted-critical-path schedule run it before the
incoming gradient arrives instead of after.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from tessera.parallel.pipeline.split import Piece


@dataclass
class MicroBatchState:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    inputs: list[torch.Tensor]
    batch: dict[str, torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    head_leaves: list[torch.Tensor] | None = None  # tail inputs when the head recomputes
    head_outputs: list[torch.Tensor] | None = None  # the recomputed head (with autograd)
    rng: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    @property
    def needs_recompute(self) -> bool:
        return self.head_leaves is not None and self.head_outputs is None


class StageRunner:
    """Runs the pieces of virtual stage ``index``.

    Args:
        index: virtual stage number.
        head: the recomputed part, or None.
        tail: the part that keeps its activations, or None (when the head is everything).
        autocast: context factory for mixed precision.
    """

    def __init__(self, index: int, head: Piece | None, tail: Piece | None,
                 autocast=contextlib.nullcontext) -> None:
        if head is None and tail is None:
            raise ValueError(f"stage {index} has no nodes")
        self.index, self.head, self.tail, self.autocast = index, head, tail, autocast
        self.first = head or tail

    def forward(self, inputs: list[torch.Tensor], batch: dict[str, torch.Tensor],
                recompute: bool, grad: bool = True) -> MicroBatchState:
        """Run the stage; with ``recompute`` the head's activations are not kept."""
        if grad:
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        state = MicroBatchState(inputs, batch)
        with torch.set_grad_enabled(grad), self.autocast():
            x = inputs
            if self.head is not None and recompute and grad:
                state.rng = torch.get_rng_state()
                with torch.no_grad():
                    x = _run(self.head, x, batch)
                x = [t.detach().requires_grad_(t.is_floating_point()) for t in x]
                state.head_leaves = x
            elif self.head is not None:
                x = _run(self.head, x, batch)
            state.outputs = _run(self.tail, x, batch) if self.tail is not None else x
        return state

    def recompute(self, state: MicroBatchState) -> None:
        """Run the head again with autograd, from the RNG state of its forward."""
        with torch.random.fork_rng(devices=[]), self.autocast():
            torch.set_rng_state(state.rng)
            state.head_outputs = _run(self.head, state.inputs, state.batch)

    def backward(self, state: MicroBatchState, grads: list[torch.Tensor] | None
                 ) -> list[torch.Tensor]:
        """Backward from ``grads`` of the outputs (or from ``state.loss``); input gradients."""
        if state.needs_recompute:
            self.recompute(state)
        if grads is None:
            state.loss.backward()
        else:
            _backward(state.outputs, grads)
        if state.head_leaves is not None:
            _backward(state.head_outputs, [leaf.grad for leaf in state.head_leaves])
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in state.inputs]


def _run(piece: Piece, inputs: list[torch.Tensor], batch: dict[str, torch.Tensor]
         ) -> list[torch.Tensor]:
    return list(piece.module(*inputs, *[batch[name] for name in piece.batch]))


def _backward(outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
