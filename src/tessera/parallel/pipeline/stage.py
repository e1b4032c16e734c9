"""One virtual stage at run time: forward, recomputation and backward of a micro-batch.

A stage is its graph pieces: when it recomputes, a *head* of one or more segments (about a
block each) whose activations are dropped after the forward (run under no_grad, only each
segment's inputs kept), then a *tail* that keeps them. In the backward the segments run again
with gradients one at a time, newest first, from the RNG state of their forward so dropout
masks repeat, so at most one segment's activations are rematerialised at once (per-layer
checkpointing). The last segment can also be recomputed as its own call before the incoming
gradient arrives, which is what the shifted-critical-path schedule does (engine.py).
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
    segment_inputs: list[list[torch.Tensor]] = field(default_factory=list)  # kept, no grad
    segment_rng: list[tuple] = field(default_factory=list)  # _rng_state per segment
    # Segments recomputed ahead of the backward: index -> (grad-enabled inputs, outputs).
    recomputed: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict)
    loss: torch.Tensor | None = None

    @property
    def needs_recompute(self) -> bool:
        """Dropped segments none of which was recomputed ahead yet."""
        return self.head_leaves is not None and not self.recomputed


class StageRunner:
    """Runs the pieces of virtual stage ``index``.

    Args:
        index: virtual stage number.
        head: the recomputed segments, in order (empty when nothing recomputes).
        tail: the part that keeps its activations, or None (when the head is everything).
        autocast: context factory for mixed precision.
    """

    def __init__(self, index: int, head: list[Piece], tail: Piece | None,
                 autocast=contextlib.nullcontext) -> None:
        if not head and tail is None:
            raise ValueError(f"stage {index} has no nodes")
        self.index, self.head, self.tail, self.autocast = index, list(head), tail, autocast
        # Set while autocast's cache lives for a whole step (PipelineProgram.step_casts): the
        # pieces then read views of the input leaves, whose casts autocast does not cache
        # (a cached copy would hold its leaf, and its gradient, until the step ends).
        self.view_inputs = False

    def pieces(self) -> list[tuple[str, Piece]]:
        """(name, piece) of every piece, head segments first."""
        named = [(f"head{i}", piece) for i, piece in enumerate(self.head)]
        return named + ([("tail", self.tail)] if self.tail is not None else [])

    def forward(self, inputs: list[torch.Tensor], batch: dict[str, torch.Tensor],
                recompute: bool, grad: bool = True) -> MicroBatchState:
        """Run the stage; with ``recompute`` the head's activations are not kept."""
        if grad:
            # Leaves that are not views (a one-tensor message arrives as a view of its
            # buffer): autocast then casts each input once for all its readers (its cache
            # holds casts of such leaves), as kept.py's estimate counts, whatever the message.
            inputs = [t.detach().requires_grad_() if t.is_floating_point() else t
                      for t in inputs]
        state = MicroBatchState(inputs, batch)
        with torch.set_grad_enabled(grad), self.autocast():
            x = inputs
            if grad and self.view_inputs:
                x = [t.view_as(t) if t.requires_grad else t for t in inputs]
            if self.head and recompute and grad:
                with torch.no_grad():
                    for segment in self.head:
                        state.segment_rng.append(_rng_state(batch))
                        state.segment_inputs.append(x)
                        x = _run(segment, x, batch)
                x = [t.detach().requires_grad_(t.is_floating_point()) for t in x]
                state.head_leaves = x
            else:
                for segment in self.head:
                    x = _run(segment, x, batch)
            state.outputs = _run(self.tail, x, batch) if self.tail is not None else x
        return state

    def recompute(self, state: MicroBatchState, segment: int | None = None) -> None:
        """Run one dropped segment again with autograd (default: the last), from the RNG
        state of its forward, ahead of the backward that needs it."""
        index = len(self.head) - 1 if segment is None else segment
        state.recomputed[index] = self._rerun(state, index)

    def _rerun(self, state: MicroBatchState, index: int):
        saved = state.segment_inputs[index]
        # The first segment reads the stage inputs, whose gradients go to the previous stage.
        inputs = saved if index == 0 else [
            t.detach().requires_grad_(t.is_floating_point()) for t in saved]
        cpu, device, cuda = state.segment_rng[index]
        with torch.random.fork_rng(devices=[device] if cuda is not None else []), \
                torch.enable_grad(), self.autocast():
            torch.set_rng_state(cpu)
            if cuda is not None:  # dropout on a GPU draws from the device's generator
                torch.cuda.set_rng_state(cuda, device)
            outputs = _run(self.head[index], inputs, state.batch)
        return inputs, outputs

    def backward(self, state: MicroBatchState, grads: list[torch.Tensor] | None
                 ) -> list[torch.Tensor]:
        """Backward from ``grads`` of the outputs (or from ``state.loss``); input gradients.
        Dropped segments are recomputed newest first, one at a time."""
        if grads is None:
            state.loss.backward()
        else:
            _backward(state.outputs, grads)
        if state.head_leaves is not None:
            grads = [leaf.grad for leaf in state.head_leaves]
            for index in reversed(range(len(self.head))):
                inputs, outputs = (state.recomputed.pop(index, None)
                                   or self._rerun(state, index))
                _backward(outputs, grads)
                grads = [t.grad if t.requires_grad else None for t in inputs]
                del inputs, outputs  # this segment's activations go before the next one's
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in state.inputs]


def _rng_state(batch: dict[str, torch.Tensor]):
    """(CPU generator state, CUDA device or None, its generator state or None): what a
    recomputation restores so that dropout masks repeat."""
    device = next((t.device for t in batch.values() if isinstance(t, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        return torch.get_rng_state(), device, torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), None, None


def _run(piece: Piece, inputs: list[torch.Tensor], batch: dict[str, torch.Tensor]
         ) -> list[torch.Tensor]:
    return list(piece.module(*inputs, *[batch[name] for name in piece.batch]))


def _backward(outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
