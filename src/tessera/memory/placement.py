"""Placement policies: which payload leaves the device, what to prefetch, where Adam runs.

``static`` is the ZeRO-Offload-like baseline on the same machinery: every parameter chunk this
rank holds stays on the device for the whole run, and gradients, fp32 masters and Adam states
live on the host, where Adam runs. Nothing moves except gradients down and parameters up.

``auto`` is PatrickStar's policy. After the warm-up iteration it knows, for every moment, the
non-model memory and each chunk's next use. When room is needed it evicts the payload used
furthest in the future (Belady's rule), it prefetches the chunks the next moment needs when
they fit without evicting anything, and it keeps the optimizer states of as many chunks on the
device as the margin left after the peak non-model memory and the parameter chunks allows
(device Adam); the other chunks run Adam on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.memory.chunk import Chunk, Kind
from tessera.memory.tiers import DEVICE, HOST

if TYPE_CHECKING:
    from tessera.memory.manager import ChunkManager

PLACEMENTS = ("auto", "static")


class StaticPlacement:
    """Parameters pinned on the device; gradients, masters and Adam states on the host."""

    name = "static"
    pins_params = True

    def victim(self, manager: "ChunkManager", candidates: list[tuple[Chunk, Kind]],
               moment: int) -> tuple[Chunk, Kind] | None:
        # Parameter chunks are pinned, so only stray non-parameter payloads can be chosen.
        return furthest(manager, candidates, moment)

    def prefetch(self, manager: "ChunkManager", moment: int) -> None:
        """Nothing to prefetch: parameter chunks never leave the device."""

    def adam_tiers(self, manager: "ChunkManager") -> dict[int, str]:
        tier = HOST if manager.host is not None else DEVICE
        return {c.index: tier for c in manager.own_chunks()}


class AutoPlacement:
    """Evict furthest next use, prefetch the next moment, device Adam within the margin."""

    name = "auto"
    pins_params = False

    def victim(self, manager: "ChunkManager", candidates: list[tuple[Chunk, Kind]],
               moment: int) -> tuple[Chunk, Kind] | None:
        return furthest(manager, candidates, moment)

    def prefetch(self, manager: "ChunkManager", moment: int) -> None:
        tracer = manager.tracer
        if not tracer.warm or manager.host is None:
            return
        ahead = moment + 1
        for index, kind in tracer.uses_at(ahead):
            chunk = manager.chunks[index]
            if kind is not Kind.PARAM or chunk.owner != manager.rank:
                continue  # remote chunks come by all-gather, which every rank must join
            if chunk.tier.get(kind) in (DEVICE, None):
                continue
            nbytes = chunk.capacity * manager.itemsize
            if manager.device.room(tracer.reserve(ahead)) >= nbytes:
                manager.place(chunk, kind, DEVICE, protect=set(), prefetch=True)

    def adam_tiers(self, manager: "ChunkManager") -> dict[int, str]:
        """The first N own chunks get device Adam, N from the margin after backward."""
        own = manager.own_chunks()
        if manager.host is None:
            return {c.index: DEVICE for c in own}
        budget = manager.device.budget
        if budget is None:
            return {c.index: DEVICE for c in own}
        margin = (budget - manager.tracer.peak_nonmodel() - manager.param_bytes_resident()
                  - manager.gather_bytes())
        per_chunk = manager.device_adam_bytes_per_element()
        tiers, spent = {}, 0
        for chunk in own:
            need = chunk.capacity * per_chunk
            fits = spent + need <= margin
            tiers[chunk.index] = DEVICE if fits else HOST
            spent += need if fits else 0
        return tiers


def furthest(manager: "ChunkManager", candidates: list[tuple[Chunk, Kind]],
             moment: int) -> tuple[Chunk, Kind] | None:
    """Belady's rule: the payload whose next use is furthest away (first one on ties)."""
    if not candidates:
        return None
    tracer = manager.tracer
    return max(candidates, key=lambda ck: tracer.next_use((ck[0].index, ck[1]), moment))


def make_policy(name: str) -> StaticPlacement | AutoPlacement:
    if name not in PLACEMENTS:
        raise ValueError(f"memory.placement must be one of {', '.join(PLACEMENTS)}, got {name!r}")
    return StaticPlacement() if name == "static" else AutoPlacement()
