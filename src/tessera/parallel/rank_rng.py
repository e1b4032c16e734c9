"""Random streams per rank for a training step: dropout masks that differ where tokens differ.

Every rank starts from the same seed (``train.seed``), so without care every rank draws the
same dropout masks at the same local positions. Where ranks hold *different* activations that
correlates masks that should be independent:

- sequence-parallel ranks hold different tokens of one sequence: the mask of token t on rank 0
  would repeat at token t + L/sp on rank 1;
- data-parallel ranks hold different samples; pipeline stages different layers.

Where ranks hold the *same* activations the masks must stay equal: tensor-parallel peers
replicate the residual stream, and a different mask on each would make the replicas diverge.

:func:`rank_stream` is entered around each step's forward and backward. It draws one seed from
the generator all ranks share (so that generator advances alike everywhere and is what a
checkpoint saves), mixes it with the rank's coordinates on every axis but the tensor-parallel
ones, and runs the step on a generator seeded with that. Everything the step draws (dropout
modules, ``F.dropout``, the attention dropout seeds of sequence parallelism) then differs per
(pp, dp, sp) coordinate and is equal across tp peers. Activation recomputation restores the
state it saved inside the step, so masks repeat as before. Megatron-LM keys its dropout seeds
the same way by pipeline stage and tensor region; it keeps data-parallel ranks equal.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Iterator

import torch

# Axes whose ranks hold replicated activations: their streams must stay equal.
SHARED_AXES = ("tp", "tp_row", "tp_col")
_ACTIVE = contextvars.ContextVar("tessera_rank_stream", default=False)


def in_rank_stream() -> bool:
    """Whether the caller runs inside :func:`rank_stream` (code whose ranks must not draw
    equal masks checks it)."""
    return _ACTIVE.get()


def stream_seed(seed: int, coordinates: dict[str, int]) -> int:
    """A 63-bit seed from the shared ``seed`` and this rank's coordinates off tp axes."""
    own = sorted((axis, rank) for axis, rank in coordinates.items() if axis not in SHARED_AXES)
    digest = hashlib.blake2b(repr((seed, own)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def rank_stream(coordinates: dict[str, int], device: torch.device | None = None
                ) -> Iterator[int]:
    """Run the body on this rank's stream (see the module doc); yields its seed.

    Args:
        coordinates: this rank's coordinate on every mesh axis (``Mesh.coordinates()``).
        device: the CUDA device whose generator dropout on it draws from, if any.
    """
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
