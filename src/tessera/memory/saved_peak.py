"""Measure activation memory on any device: the peak of what autograd saves for backward.

CPU tensors have no allocator statistics to read (``torch.cuda.max_memory_allocated`` has no
CPU twin), so the benchmarks and tests that compare schedules' activation memory count the
tensors autograd saves instead: distinct storages, parameters excluded, live from the moment
they are saved until the graph holding them is freed. Tensors a pipeline stage keeps outside
autograd (a recomputing stage's input) are not counted.

    probe = SavedPeak(model.parameters())
    with probe:
        engine.forward_backward(batches)
    probe.peak  # bytes
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class LiveStorages:
    """Bytes of the storages held at the moment, counted once however many tensors hold
    one, and their peak (shared by SavedPeak and the sequence-parallel benchmark's
    allocation mode)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._holders: dict[int, int] = {}  # storage key -> holders
        self._sizes: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._holders

    def acquire(self, key: int, nbytes: int) -> None:
        """One more holder of storage ``key`` (of ``nbytes``)."""
        if key not in self._holders:
            self._holders[key], self._sizes[key] = 0, nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[key] += 1

    def release(self, key: int) -> None:
        """One holder fewer; the storage stops counting with its last holder."""
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._sizes.pop(key)


class _Held:
    """One saved tensor; its release (when autograd frees the graph) lowers the live count."""

    __slots__ = ("tensor", "storages", "key")

    def __init__(self, tensor: torch.Tensor, storages: LiveStorages, key: int) -> None:
        self.tensor, self.storages, self.key = tensor, storages, key

    def __del__(self) -> None:
        self.storages.release(self.key)


class SavedPeak:
    """Context manager tracking the peak bytes of distinct storages saved for backward."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._params = {_storage_key(p) for p in params}
        self._storages = LiveStorages()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def live(self) -> int:
        """Bytes saved for backward now."""
        return self._storages.live

    @property
    def peak(self) -> int:
        """The most bytes saved for backward at once since the probe was made."""
        return self._storages.peak

    def __enter__(self) -> SavedPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self._params or key == 0:
            return tensor
        local = getattr(tensor, "_local_tensor", tensor)
        self._storages.acquire(key, local.untyped_storage().nbytes())
        return _Held(tensor, self._storages, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed


def _storage_key(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
    return local.untyped_storage().data_ptr()
