"""Tensor states, the table of legal transitions, and the state of a chunk derived from them.

A parameter tensor inside a chunk moves through these states during one iteration::

    FREE --gather/load--> HOLD --pre-forward--> COMPUTE --post-forward--> HOLD_AFTER_FWD
      ^                                                                       |
      |                          pre-backward (or a tied weight's 2nd use)    v
      +--release-- HOLD_AFTER_BWD <--post-backward (grad stored)-- COMPUTE <--+

The chunk's state is RELEASED when it holds no payload; otherwise it is the highest-priority
state among its tensors (COMPUTE > HOLD > HOLD_AFTER_FWD > HOLD_AFTER_BWD > FREE): a chunk with
any tensor in COMPUTE must stay on the compute device.
"""

from __future__ import annotations

import enum


class TensorState(enum.Enum):
    """Where one parameter tensor stands in the iteration."""

    FREE = "free"  # payload not held here (remote ZeRO shard, or released)
    HOLD = "hold"  # payload held, not in use
    COMPUTE = "compute"  # in use by a forward or backward computation: must stay on device
    HOLD_AFTER_FWD = "hold_after_fwd"  # forward done; backward will need it again
    HOLD_AFTER_BWD = "hold_after_bwd"  # backward done, its gradient is stored


S = TensorState

# Each legal transition, with the event that takes it. Anything else is a bug and raises.
LEGAL_TRANSITIONS: dict[tuple[TensorState, TensorState], str] = {
    (S.FREE, S.HOLD): "payload gathered or loaded",
    (S.FREE, S.COMPUTE): "fetched on first use",
    (S.HOLD, S.COMPUTE): "pre-forward or pre-backward",
    (S.HOLD, S.FREE): "remote payload released",
    (S.COMPUTE, S.HOLD): "forward without gradients (evaluation) ended",
    (S.COMPUTE, S.HOLD_AFTER_FWD): "post-forward",
    (S.COMPUTE, S.HOLD_AFTER_BWD): "post-backward: gradient stored",
    (S.HOLD_AFTER_FWD, S.COMPUTE): "pre-backward, or reuse of a tied weight",
    (S.HOLD_AFTER_FWD, S.FREE): "remote payload released after forward",
    (S.HOLD_AFTER_FWD, S.HOLD): "iteration ended without backward",
    (S.HOLD_AFTER_BWD, S.COMPUTE): "next micro-batch's forward (gradient accumulation)",
    (S.HOLD_AFTER_BWD, S.HOLD): "optimizer step done",
    (S.HOLD_AFTER_BWD, S.FREE): "remote payload released after backward",
}

# Priority of tensor states when deriving a chunk's state (higher wins).
_PRIORITY = {S.COMPUTE: 4, S.HOLD: 3, S.HOLD_AFTER_FWD: 2, S.HOLD_AFTER_BWD: 1, S.FREE: 0}


class IllegalTransitionError(RuntimeError):
    """A tensor was asked to move between two states that the table does not link."""


class ChunkState(enum.Enum):
    """State of a whole chunk: RELEASED, or the strongest state of its tensors."""

    RELEASED = "released"
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


def check_transition(name: str, old: TensorState, new: TensorState) -> None:
    """Raise :class:`IllegalTransitionError` unless ``old -> new`` is in the table.

    A state moving to itself is allowed (hooks may fire twice for a shared module).
    """
    if old is new or (old, new) in LEGAL_TRANSITIONS:
        return
    legal = ", ".join(n.name for (o, n) in LEGAL_TRANSITIONS if o is old)
    raise IllegalTransitionError(
        f"tensor {name}: illegal state transition {old.name} -> {new.name}; from {old.name} "
        f"the legal next states are {legal}")


def chunk_state(states: list[TensorState], has_payload: bool) -> ChunkState:
    """The state of a chunk holding tensors in ``states``."""
    if not has_payload:
        return ChunkState.RELEASED
    if not states:
        return ChunkState.FREE
    strongest = max(states, key=_PRIORITY.__getitem__)
    return ChunkState[strongest.name]


class TransitionLog:
    """The set of transitions taken so far (tests check every legal one is exercised)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[TensorState, TensorState], int] = {}

    def record(self, old: TensorState, new: TensorState) -> None:
        if old is not new:
            self.seen[(old, new)] = self.seen.get((old, new), 0) + 1
