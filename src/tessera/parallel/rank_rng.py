"""Random streams per rank for a training step: dropout masks that differ where tokens differ.

Every rank starts from the same seed (``train.seed``), so without care every rank draws the
same dropout masks at the same local positions. Where ranks hold *different* activations that
correlates masks that should be independent:

- sequence-parallel ranks hold different tokens of one sequence: the mask of token t on rank 0
  would repeat at token t + L/sp on rank 1;
- data-parallel ranks hold different samples; pipeline stages different layers; the ranks of
  a 2D tensor-parallel grid different (batch, feature) blocks.

Where ranks hold the *same* activations the masks must stay equal: 1D tensor-parallel peers
replicate the residual stream, and a different mask on each would make the replicas diverge.

:func:`rank_stream` is entered around each step's forward and backward. It mixes the step's
shared seed (:func:`step_seed`: the run's seed and the step number, so the same on every rank
and after a resume, whatever state the generators are in) with the rank's coordinates on
every axis but 1D tensor parallelism's, and runs the step on a generator seeded with that.
Everything the step draws (dropout modules, ``F.dropout``, the attention dropout seeds of
sequence parallelism and of 1D tp) then differs per (pp, dp, sp, 2D grid) coordinate and is
equal across 1D tp peers. Activation recomputation restores the state it saved inside the
step, so masks repeat as before. Megatron-LM keys its dropout seeds by pipeline stage and
tensor region; it keeps data-parallel ranks equal.

Attention dropout falls on what 1D tp peers split (each holds its own heads), so it must not
draw its mask from their shared stream, or rank 1's head group would repeat rank 0's. It
draws only a seed from it (equal on the peers) and keys the mask by the layer's head index
with a hash (sequence/dropout.py): sequence-parallel attention does so at sp > 1,
tensor/attention.py at sp = 1. Not covered: other dropout on split tensors (Megatron
sequence parallelism's sequence chunks, which therefore refuses dropout); Megatron forks a
second generator for those regions.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Iterator

import torch

# Axes whose ranks hold replicated activations: their streams must stay equal. (2D tensor
# parallelism's tp_row / tp_col hold distinct blocks, layers2d.py.)
SHARED_AXES = ("tp",)
_ACTIVE = contextvars.ContextVar("tessera_rank_stream", default=False)


def in_rank_stream() -> bool:
    """Whether the caller runs inside :func:`rank_stream` (code whose ranks must not draw
    equal masks checks it)."""
    return _ACTIVE.get()


def _hash63(value: object) -> int:
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def step_seed(seed: int, step: int) -> int:
    """The shared seed of step ``step`` of a run seeded ``seed``: a function of the two only."""
    return _hash63(("step", seed, step))


def stream_seed(seed: int, coordinates: dict[str, int]) -> int:
    """A 63-bit seed from the shared ``seed`` and this rank's coordinates off 1D tp."""
    own = sorted((axis, rank) for axis, rank in coordinates.items() if axis not in SHARED_AXES)
    return _hash63((seed, own))


@contextlib.contextmanager
def rank_stream(coordinates: dict[str, int], device: torch.device | None = None,
                shared: int | None = None) -> Iterator[int]:
    """Run the body on this rank's stream (see the module doc); yields its seed.

    Args:
        coordinates: this rank's coordinate on every mesh axis (``Mesh.coordinates()``).
        device: the CUDA device whose generator dropout on it draws from, if any.
        shared: the seed every rank shares for this step (:func:`step_seed`); None draws it
            from torch's generator, which then advances by one draw on every rank.
    """
    if shared is None:
        shared = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())
    seed = stream_seed(shared, coordinates)
    cuda = device is not None and device.type == "cuda"
    token = _ACTIVE.set(True)
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            torch.default_generator.manual_seed(seed)
            if cuda:
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(seed)
            yield seed
    finally:
        _ACTIVE.reset(token)
