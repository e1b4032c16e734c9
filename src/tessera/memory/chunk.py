"""Chunks: fixed-size flat buffers that hold many parameters back to back, and the size search.

Parameters are laid out in registration order (so one module's tensors sit together and a
module touches few chunks). Every chunk index has one buffer per kind (compute parameters,
gradients, fp32 masters, Adam momentum and variance) with the same layout, so "chunk i" means
the same parameters in every kind and the optimizer updates matching flat buffers in one go.

Tensors larger than the chunk size get a chunk of their own, sized to them (rounded up to the
alignment): nothing is split across chunks, so a parameter is always one contiguous view, and
the size search below tries sizes from the largest tensor up, so this only happens when the
user fixes a smaller ``chunk_size``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.memory.tensor_state import TensorState


class Kind(enum.Enum):
    """What a chunk buffer holds."""

    PARAM = "param"  # compute precision (fp32, bf16 or fp16): what forward and backward read
    GRAD = "grad"  # gradients, compute precision
    MASTER = "master"  # fp32 master parameters (absent when PARAM is fp32 and updated in place)
    MOMENTUM = "momentum"  # Adam first moment, fp32
    VARIANCE = "variance"  # Adam second moment, fp32


@dataclass
class TensorSlot:
    """One parameter's place in a chunk."""

    name: str
    param: nn.Parameter
    offset: int  # first element in the chunk
    numel: int
    shape: torch.Size
    group: int  # optimizer param group (0: weight decay, 1: none)
    state: TensorState = TensorState.HOLD

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Chunk:
    """One chunk index: the layout shared by every kind, its owner, and where each kind is.

    Attributes:
        index: position in the chunk list.
        capacity: elements per buffer.
        owner: the data-parallel rank that keeps and updates this chunk (ZeRO).
        slots: the parameters laid out in it (empty for padding chunks).
        payload: per kind, the flat buffer, or absent when released.
        tier: per kind, "device", "host" or "disk" while a payload exists.
    """

    index: int
    capacity: int
    owner: int = 0
    slots: list[TensorSlot] = field(default_factory=list)
    payload: dict[Kind, torch.Tensor] = field(default_factory=dict)
    tier: dict[Kind, str] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return self.slots[-1].end if self.slots else 0

    def states(self) -> list[TensorState]:
        return [slot.state for slot in self.slots]

    def in_compute(self) -> bool:
        return any(slot.state is TensorState.COMPUTE for slot in self.slots)


def pack(numels: list[int], capacity: int, align: int = 1) -> list[tuple[int, list[int]]]:
    """Greedy in-order packing: a list of (chunk capacity, tensor indices) per chunk.

    A tensor larger than ``capacity`` gets a chunk of its own, of its size rounded up to
    ``align``.
    """
    chunks: list[tuple[int, list[int]]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(numels):
        if n > capacity:  # close the open chunk first, so the layout keeps its order
            if current:
                chunks.append((capacity, current))
                current, used = [], 0
            chunks.append((_round_up(n, align), [i]))
            continue
        if used + n > capacity:
            chunks.append((capacity, current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        chunks.append((capacity, current))
    return chunks


def wasted_elements(numels: list[int], capacity: int, world: int = 1, align: int = 1) -> int:
    """Elements allocated but unused with this capacity, including ZeRO padding chunks."""
    chunks = pack(numels, capacity, align)
    dummies = (-len(chunks)) % world
    return sum(c for c, _ in chunks) + dummies * capacity - sum(numels)


def rank_peak_elements(numels: list[int], capacity: int, world: int = 1, align: int = 1,
                       state_per_element: float = 3.0) -> float:
    """Model data one rank holds at its peak with this capacity, in compute-precision elements.

    Every rank owns one chunk of each ZeRO group, allocated at the group's width, for which it
    keeps parameters and gradients (1 element each) and fp32 Adam states and masters
    (``state_per_element`` elements); while a group is in use it also holds the group's other
    ``world - 1`` parameter chunks and, in backward, their gradient chunks. Larger chunks waste
    less padding but make that gathered group larger.
    """
    chunks = pack(numels, capacity, align)
    chunks += [(capacity, [])] * ((-len(chunks)) % world)
    widths = [max(c for c, _ in chunks[g: g + world]) for g in range(0, len(chunks), world)]
    return sum(widths) * (2 + state_per_element) + 2 * (world - 1) * max(widths)


def search_chunk_size(numels: list[int], world: int = 1, max_capacity: int | None = None,
                      align: int = 256, steps: int = 64, state_per_element: float = 3.0) -> int:
    """The chunk capacity (elements) with the least model data per rank at its peak.

    The objective is :func:`rank_peak_elements`: padding wasted in every kind, plus (under
    ZeRO, ``world > 1``) the remote chunks of the largest gathered group. With one rank this is
    the capacity wasting the fewest elements. Candidates run from the largest tensor upwards
    in ``steps`` steps of 1/16 of it (at least ``align``). ``max_capacity`` (from the device
    budget: a group of ``world`` parameter and gradient chunks must fit) caps them; when even
    the largest tensor is over the cap, sizes below it are tried and the large tensors get
    chunks of their own. Ties go to the smaller size, which gives the placement finer control.
    """
    largest = _round_up(max(numels), align)
    step = max(align, _round_up(largest // 16, align))
    candidates = [largest + i * step for i in range(steps)]
    if max_capacity is not None:
        cap = max(align, max_capacity // align * align)
        candidates = [c for c in candidates if c <= cap] or [cap]
    return min(candidates, key=lambda c: (
        rank_peak_elements(numels, c, world, align, state_per_element), c))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align
