"""Warm-up statistics: non-model memory at every moment and the order chunks are used in.

A *moment* ticks at every hooked module's pre-forward and pre-backward, and at each chunk's
optimizer update. During the warm-up iteration the tracer records, per moment, the peak
non-model memory until the next moment and the chunks accessed. Afterwards the iteration is
assumed to repeat (same model, same batch shape), so moment ``m`` of a later iteration is moment
``m mod period`` of the warm-up: the manager knows how much memory activations will need next
and when each chunk is used next.

Non-model memory on CUDA is ``memory_allocated - chunk bytes on the device``. On the CPU there is
no allocator to ask, so it is the bytes of tensors autograd saves for backward (activations),
counted once per storage while saved; chunk-backed tensors (parameters and their views) are
excluded because the manager saves them as references, not copies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class Moment:
    """What the warm-up saw at one moment."""

    label: str
    nonmodel_peak: int = 0  # peak non-model bytes from this moment to the next
    chunk_bytes: int = 0  # chunk payload bytes on the device at this moment
    accessed: list = field(default_factory=list)  # (chunk index, kind) used
    evictions: int = 0  # chunks evicted from the device at this moment
    peak_chunks: int = 0  # chunk bytes at this moment's accounted peak
    peak_nonmodel: int = 0  # non-model bytes at that same instant


class MemoryTracer:
    """Moments, live non-model bytes and chunk access order (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.moments: list[Moment] = []  # the warm-up iteration: the schedule
        self.current: list[Moment] = []  # the iteration in progress
        self.last: list[Moment] = []  # the last finished iteration (for the timeline)
        self.period = 0  # moments per iteration, known after warm-up
        self.warm = False
        self.now = -1  # current moment in the current iteration
        self.live = 0  # non-model bytes saved for backward right now (CPU)
        self._storages: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self._uses: dict[object, list[int]] = {}  # payload key -> sorted moments of use

    # ------------------------------------------------------------------------ moments
    def tick(self, label: str, chunk_bytes: int) -> int:
        """Start a new moment; returns its index within the iteration."""
        self._close_cuda_moment(chunk_bytes)
        self.now += 1
        if self.warm:
            self.now %= self.period
        self.current.append(Moment(label, self.nonmodel(chunk_bytes), chunk_bytes))
        return self.now

    def access(self, key: object) -> None:
        """Payload ``key`` (chunk index, kind) is used at the current moment."""
        if self.current and key not in self.current[-1].accessed:
            self.current[-1].accessed.append(key)

    def note_chunk_bytes(self, chunk_bytes: int) -> None:
        if self.current:
            moment = self.current[-1]
            moment.chunk_bytes = max(moment.chunk_bytes, chunk_bytes)

    def note_accounted(self, chunk_bytes: int, nonmodel: int) -> None:
        """Keep the instant of this moment with the most accounted bytes (for the timeline)."""
        if self.current:
            moment = self.current[-1]
            if chunk_bytes + nonmodel > moment.peak_chunks + moment.peak_nonmodel:
                moment.peak_chunks, moment.peak_nonmodel = chunk_bytes, nonmodel

    def note_eviction(self) -> None:
        if self.current:
            self.current[-1].evictions += 1

    def end_iteration(self) -> None:
        """The optimizer step finished: the warm-up iteration (if this was it) is complete."""
        if not self.warm and self.current:
            self.moments = self.current
            self.period = len(self.moments)
            for m, moment in enumerate(self.moments):
                for key in moment.accessed:
                    self._uses.setdefault(key, []).append(m)
            self.warm = True
        if self.current:
            self.last = self.current
        self.current = []
        self.now = -1

    # -------------------------------------------------------------------- non-model bytes
    def nonmodel(self, chunk_bytes: int = 0) -> int:
        if self.cuda:
            return max(0, torch.cuda.memory_allocated() - chunk_bytes)
        return self.live

    def grow(self, storage_ptr: int, nbytes: int) -> None:
        """A tensor was saved for backward."""
        entry = self._storages.get(storage_ptr)
        if entry is None:
            self._storages[storage_ptr] = [nbytes, 1]
            self.live += nbytes
            if self.current:
                self.current[-1].nonmodel_peak = max(self.current[-1].nonmodel_peak, self.live)
        else:
            entry[1] += 1

    def shrink(self, storage_ptr: int) -> None:
        """A saved tensor was released by autograd."""
        entry = self._storages.get(storage_ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[storage_ptr]
            self.live -= entry[0]

    def _close_cuda_moment(self, chunk_bytes: int) -> None:
        if self.cuda and self.current:
            peak = torch.cuda.max_memory_allocated() - chunk_bytes
            self.current[-1].nonmodel_peak = max(self.current[-1].nonmodel_peak, peak)
            torch.cuda.reset_peak_memory_stats()

    # ------------------------------------------------------------------ after the warm-up
    def reserve(self, moment: int) -> int:
        """Non-model bytes to keep free at ``moment``: its peak and the next moment's."""
        if not self.warm:
            return self.live
        here = self.moments[moment % self.period].nonmodel_peak
        ahead = self.moments[(moment + 1) % self.period].nonmodel_peak
        return max(here, ahead)

    def peak_nonmodel(self) -> int:
        """Peak non-model bytes of the warm-up (of the iteration so far while warming up)."""
        return max((m.nonmodel_peak for m in self.moments or self.current), default=0)

    def next_use(self, key: object, moment: int) -> float:
        """Moments until payload ``key`` is next used after ``moment`` (inf: never)."""
        uses = self._uses.get(key)
        if not self.warm or not uses:
            return float("inf")
        i = bisect.bisect_right(uses, moment)
        return uses[i] - moment if i < len(uses) else uses[0] + self.period - moment

    def uses_at(self, moment: int) -> list:
        """Payloads the warm-up used at ``moment`` (for prefetching)."""
        if not self.warm:
            return []
        return self.moments[moment % self.period].accessed
